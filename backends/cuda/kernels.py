"""The cuda backend's own kernels: the shared CUDA-dialect sources
(glm5_hal/backends/_cuda_dialect/src) compiled with nvcc into libglm5_hal_cuda_kernels.so next to
this module, by CMake when nvcc is found (GLM5_HAL_WITH_CUDA; backends/cuda/csrc). Loaded lazily;
when absent, the adapters that need it decline with "CUDA kernel not built"."""
from __future__ import annotations

import sys
from pathlib import Path

from glm5_hal.backends._cuda_dialect import GpuKernelLibrary, library_path

LIBRARY_NAME = "libglm5_hal_cuda_kernels.so"


def cuda_kernels(path: Path | None = None) -> GpuKernelLibrary:
    path = path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME)
    return GpuKernelLibrary(path, label="CUDA kernel", target="cuda",
                            hint="rebuild glm5_hal with nvcc on PATH or CUDA_HOME set (GLM5_HAL_WITH_CUDA)")
