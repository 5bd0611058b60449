"""The backend's own XPU C++ kernels (csrc/), for what kunlun_ops does not provide.

CMake builds them into `libglm5_hal_kunlun_kernels.so` next to this module, only when the
XTDK toolchain is found (XTDK_PATH). The library is loaded lazily with ctypes; when it is
absent the adapters that need it decline with "kunlun kernel not built", so dispatch moves
on. Host entry points take raw device pointers, sizes and the current XPU stream (under
xpytorch's CUDA-compatible mode: the `cuda_stream` handle of torch.cuda's current stream),
like the shared csrc/ kernels take pointers and sizes (csrc/glm5_hal_kunlun.h).
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from glm5_hal.kernel_library import KernelLibrary as _KernelLibrary, library_path

LIBRARY_NAME = "libglm5_hal_kunlun_kernels.so"
#: dtype codes of csrc/glm5_hal_kunlun.h
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_c_i64, _c_ptr = ctypes.c_int64, ctypes.c_void_p


class KernelLibrary(_KernelLibrary):
    """Lazily loaded XPU kernels; `missing()` says why they cannot be used."""
    signatures = {
        "glm5_hal_xpu_sparse_mla_decode_paged": (
            ctypes.c_int, [_c_ptr] * 7 + [_c_i64] * 9 + [ctypes.c_float, ctypes.c_int, _c_ptr]),
        "glm5_hal_xpu_kv_cache_gather": (ctypes.c_int, [_c_ptr] * 5 + [_c_i64] * 5 + [_c_ptr]),
    }

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME),
                         label="kunlun kernel", hint="rebuild glm5_hal with XTDK_PATH set and GLM5_HAL_WITH_KUNLUN=ON")

    def sparse_mla_decode_paged(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                context_lens: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                                lse: torch.Tensor, sm_scale: float, stream: int) -> None:
        """Same contract as the cambricon kernel: contiguous device tensors q [B, N, H, Dqk],
        kv_cache [num_blocks, block_size, Dqk], block_table int32 [B, max_blocks], context_lens
        int32 [B], indices int32 [B, N, topk], out [B, N, H, d_v], lse fp32 [B, N, H]."""
        batch, queries, heads, dqk = q.shape
        status = self.call("glm5_hal_xpu_sparse_mla_decode_paged",
            q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), context_lens.data_ptr(),
            indices.data_ptr(), out.data_ptr(), lse.data_ptr(),
            batch, queries, heads, dqk, out.shape[-1], indices.shape[-1],
            kv_cache.shape[0], kv_cache.shape[1], block_table.shape[1],
            float(sm_scale), DTYPE_CODE[q.dtype], stream)
        if status != 0:
            raise RuntimeError(f"glm5_hal_xpu_sparse_mla_decode_paged failed with status {status}")

    def kv_cache_gather(self, cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                        out_offsets: torch.Tensor, out: torch.Tensor, stream: int) -> None:
        """Copies sequence b's rows [0, context_lens[b]) to out[out_offsets[b] + p] (a byte copy
        of rows of cache.shape[2] elements: any element type). out_offsets is int64 [B]."""
        row_bytes = cache.shape[2] * cache.element_size()
        status = self.call("glm5_hal_xpu_kv_cache_gather",
            cache.data_ptr(), block_table.data_ptr(), context_lens.data_ptr(), out_offsets.data_ptr(),
            out.data_ptr(), block_table.shape[0], cache.shape[0], cache.shape[1], block_table.shape[1],
            row_bytes, stream)
        if status != 0:
            raise RuntimeError(f"glm5_hal_xpu_kv_cache_gather failed with status {status}")
