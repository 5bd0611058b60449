"""The backend's own XPU C++ kernels (csrc/), for what kunlun_ops does not provide.

CMake builds them into `libglm5_hal_kunlun_kernels.so` next to this module, only when the
XTDK toolchain is found (XTDK_PATH). The library is loaded lazily with ctypes; when it is
absent the adapters that need it decline with "kunlun kernel not built", so dispatch moves
on. It exports the paged sparse MLA decode kernel of glm5_hal_kernel_abi.h (the interface,
launcher and adapter every kernel library with that kernel shares: glm5_hal.vendor_ops.dsa)
and kv_cache_gather (csrc/glm5_hal_kunlun.h). The stream is the XPU stream, under
xpytorch's CUDA-compatible mode the `cuda_stream` handle of torch.cuda's current stream.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from glm5_hal.kernel_library import library_path
from glm5_hal.vendor_ops.dsa import DecodeLimits, SparseMlaDecodeLibrary

LIBRARY_NAME = "libglm5_hal_kunlun_kernels.so"

_c_i64, _c_ptr = ctypes.c_int64, ctypes.c_void_p


class KernelLibrary(SparseMlaDecodeLibrary):
    """Lazily loaded XPU kernels; `missing()` says why they cannot be used."""
    signatures = {
        **SparseMlaDecodeLibrary.signatures,
        "glm5_hal_xpu_kv_cache_gather": (ctypes.c_int, [_c_ptr] * 5 + [_c_i64] * 5 + [_c_ptr]),
    }
    # csrc/paged_kernels.xpu: kMaxDqk (local-memory tiling), heads <= 128, int32 cache rows
    decode_limits = DecodeLimits("the XPU sparse decode kernel", max_dqk=1024, max_heads=128, int32_rows=True)

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME),
                         label="kunlun kernel", hint="rebuild glm5_hal with XTDK_PATH set and GLM5_HAL_WITH_KUNLUN=ON")

    def kv_cache_gather(self, cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                        out_offsets: torch.Tensor, out: torch.Tensor, stream: int) -> None:
        """Copies sequence b's rows [0, context_lens[b]) to out[out_offsets[b] + p] (a byte copy
        of rows of cache.shape[2] elements: any element type). out_offsets is int64 [B]."""
        row_bytes = cache.shape[2] * cache.element_size()
        self.launch("glm5_hal_xpu_kv_cache_gather",
                    cache.data_ptr(), block_table.data_ptr(), context_lens.data_ptr(), out_offsets.data_ptr(),
                    out.data_ptr(), block_table.shape[0], cache.shape[0], cache.shape[1], block_table.shape[1],
                    row_bytes, stream)
