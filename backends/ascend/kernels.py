"""The backend's own Ascend C kernels (csrc/), for what torch_npu does not provide.

CMake builds them into `libglm5_hal_ascend_kernels.so` next to this module, only when
CANN's Ascend C toolchain is found (`ASCEND_HOME_PATH`). The library is loaded lazily with
ctypes; when it is absent the adapters that need it decline with "Ascend C kernel not
built", so dispatch moves on. Host entry points take raw device pointers, sizes and the
current aclrtStream, like the shared csrc/ kernels take pointers and sizes.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from glm5_hal.kernel_library import DTYPE_CODE, KernelLibrary as _KernelLibrary, library_path

LIBRARY_NAME = "libglm5_hal_ascend_kernels.so"


class KernelLibrary(_KernelLibrary):
    """Lazily loaded Ascend C kernels; `missing()` says why they cannot be used."""
    signatures = {"glm5_hal_ascend_hadamard": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
        ctypes.c_void_p])}

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME),
                         label="Ascend C kernel", hint="rebuild glm5_hal with ASCEND_HOME_PATH set (GLM5_HAL_WITH_ASCEND)")

    def hadamard(self, x: torch.Tensor, out: torch.Tensor, scale: float, stream: int) -> None:
        """out[r] = (x[r] @ H_D) * scale for every row of the contiguous [rows, D] tensors."""
        self.launch("glm5_hal_ascend_hadamard", x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], float(scale),
                    DTYPE_CODE[x.dtype], stream)
