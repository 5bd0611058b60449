"""The musa backend's own kernels: the shared CUDA-dialect sources
(glm5_hal/backends/_cuda_dialect/src) compiled with mcc into libglm5_hal_musa_kernels.so next to
this module, by CMake when the MUSA SDK is found (GLM5_HAL_WITH_MUSA; backends/musa/csrc).
Loaded lazily; when absent, the adapters that need it decline with "MUSA kernel not built"."""
from __future__ import annotations

import sys
from pathlib import Path

from glm5_hal.backends._cuda_dialect import GpuKernelLibrary, library_path

LIBRARY_NAME = "libglm5_hal_musa_kernels.so"


def musa_kernels(path: Path | None = None) -> GpuKernelLibrary:
    path = path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME)
    return GpuKernelLibrary(path, label="MUSA kernel",
                            target="musa", hint="rebuild glm5_hal with MUSA_HOME set so that CMake finds mcc "
                                                "(GLM5_HAL_WITH_MUSA)")
