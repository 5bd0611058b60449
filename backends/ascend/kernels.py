"""The backend's own Ascend C kernels (csrc/), for what torch_npu does not provide.

CMake builds them into `libglm5_hal_ascend_kernels.so` next to this module, only when
CANN's Ascend C toolchain is found (`ASCEND_HOME_PATH`). The library is loaded lazily with
ctypes; when it is absent the adapters that need it decline with "Ascend C kernel not
built", so dispatch moves on. Host entry points take raw device pointers, sizes and the
current aclrtStream, like the shared csrc/ kernels take pointers and sizes.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

LIBRARY_NAME = "libglm5_hal_ascend_kernels.so"
#: dtype codes of csrc/glm5_hal_ascend.h
DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 0}


class KernelLibrary:
    """Lazily loaded Ascend C kernels; `missing()` says why they cannot be used."""

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
            self._error = (f"Ascend C kernel not built ({LIBRARY_NAME} not found next to "
                           f"glm5_hal.backends.ascend; rebuild glm5_hal with ASCEND_HOME_PATH set)")
            return
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            self._error = f"Ascend C kernel library does not load: {exc}"
            return
        lib.glm5_hal_ascend_hadamard.restype = ctypes.c_int
        lib.glm5_hal_ascend_hadamard.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
            ctypes.c_int, ctypes.c_void_p]
        self._lib = lib

    def hadamard(self, x: torch.Tensor, out: torch.Tensor, scale: float, stream: int) -> None:
        """out[r] = (x[r] @ H_D) * scale for every row of the contiguous [rows, D] tensors."""
        lib = self._lib
        if lib is None:
            raise RuntimeError(self.missing() or "Ascend C kernel library not loaded")
        status = lib.glm5_hal_ascend_hadamard(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                              float(scale), DTYPE_CODE[x.dtype], stream)
        if status != 0:
            raise RuntimeError(f"glm5_hal_ascend_hadamard failed with aclError {status}")
