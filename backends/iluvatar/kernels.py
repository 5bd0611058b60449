"""The iluvatar backend's own kernels: the shared CUDA-dialect sources
(glm5_hal/backends/_cuda_dialect/src) compiled by CoreX's clang++ for ivcore11 into
libglm5_hal_iluvatar_kernels.so next to this module, by CMake when the CoreX SDK is found
(GLM5_HAL_WITH_ILUVATAR; backends/iluvatar/csrc). CoreX takes CUDA sources and cuda_runtime.h
as they are, so the library reports the "cuda" target. Loaded lazily; when absent, the
adapters that need it decline with "CoreX kernel not built"."""
from __future__ import annotations

import sys
from pathlib import Path

from glm5_hal.backends._cuda_dialect import GpuKernelLibrary, library_path

LIBRARY_NAME = "libglm5_hal_iluvatar_kernels.so"


def iluvatar_kernels(path: Path | None = None) -> GpuKernelLibrary:
    path = path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME)
    return GpuKernelLibrary(path, label="CoreX kernel", target="cuda",
                            hint="rebuild glm5_hal on a CoreX machine (/usr/local/corex/bin/clang++ found: "
                                 "GLM5_HAL_WITH_ILUVATAR)")
