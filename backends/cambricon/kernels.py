"""The backend's own BANG C kernels (csrc/), for what torch_mlu_ops does not provide.

CMake builds them into `libglm5_hal_cambricon_kernels.so` next to this module, only when
Cambricon's Neuware toolchain is found (NEUWARE_HOME, cncc, find_package(BANG)). The library
is loaded lazily with ctypes; when it is absent the adapters that need it decline with
"cambricon kernel not built", so dispatch moves on. Host entry points take raw device
pointers, sizes and the current cnrtQueue_t, like the shared csrc/ kernels take pointers
and sizes (csrc/glm5_hal_cambricon.h is the contract).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

LIBRARY_NAME = "libglm5_hal_cambricon_kernels.so"
#: dtype codes of csrc/glm5_hal_cambricon.h
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_c_i64, _c_ptr = ctypes.c_int64, ctypes.c_void_p


class KernelLibrary:
    """Lazily loaded BANG C kernels; `missing()` says why they cannot be used."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or Path(__file__).resolve().with_name(LIBRARY_NAME)
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None

    def missing(self) -> str | None:
        if self._lib is None and self._error is None:
            self._load()
        return self._error

    def status(self) -> str:
        reason = self.missing()
        return f"built ({self.path})" if reason is None else reason

    def _load(self) -> None:
        if not self.path.exists():
            self._error = (f"cambricon kernel not built ({LIBRARY_NAME} not found next to "
                           "glm5_hal.backends.cambricon; rebuild glm5_hal with NEUWARE_HOME set "
                           "and GLM5_HAL_WITH_CAMBRICON=ON)")
            return
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            self._error = f"cambricon kernel library does not load: {exc}"
            return
        fn = lib.glm5_hal_mlu_sparse_mla_decode_paged
        fn.restype = ctypes.c_int
        fn.argtypes = [_c_ptr] * 7 + [_c_i64] * 9 + [ctypes.c_float, ctypes.c_int, _c_ptr]
        self._lib = lib

    def sparse_mla_decode_paged(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                context_lens: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                                lse: torch.Tensor, sm_scale: float, queue: int) -> None:
        """Launches the kernel on `queue`. Every tensor is contiguous on the MLU: q
        [B, N, H, Dqk], kv_cache [num_blocks, block_size, Dqk], block_table int32 [B, max_blocks],
        context_lens int32 [B], indices int32 [B, N, topk], out [B, N, H, d_v], lse fp32 [B, N, H]."""
        lib = self._lib
        if lib is None:
            raise RuntimeError(self.missing() or "cambricon kernel library not loaded")
        batch, queries, heads, dqk = q.shape
        status = lib.glm5_hal_mlu_sparse_mla_decode_paged(
            q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), context_lens.data_ptr(),
            indices.data_ptr(), out.data_ptr(), lse.data_ptr(),
            batch, queries, heads, dqk, out.shape[-1], indices.shape[-1],
            kv_cache.shape[0], kv_cache.shape[1], block_table.shape[1],
            float(sm_scale), DTYPE_CODE[q.dtype], queue)
        if status != 0:
            raise RuntimeError(f"glm5_hal_mlu_sparse_mla_decode_paged failed with status {status}")
