"""The dcu backend's own kernels: the shared CUDA-dialect sources
(glm5_hal/backends/_cuda_dialect/src) compiled with hipcc into libglm5_hal_dcu_kernels.so next to
this module, by CMake when DTK / ROCm is found (GLM5_HAL_WITH_DCU; backends/dcu/csrc).
Loaded lazily; when absent, the adapters that need it decline with "DCU kernel not built"."""
from __future__ import annotations

import sys
from pathlib import Path

from glm5_hal.backends._cuda_dialect import GpuKernelLibrary, library_path

LIBRARY_NAME = "libglm5_hal_dcu_kernels.so"


def dcu_kernels(path: Path | None = None) -> GpuKernelLibrary:
    path = path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME)
    return GpuKernelLibrary(path, label="DCU kernel", target="hip",
                            hint="rebuild glm5_hal with ROCM_PATH set (source DTK's env.sh) so that CMake finds "
                                 "hipcc (GLM5_HAL_WITH_DCU)")
