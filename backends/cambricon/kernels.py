"""The backend's own BANG C kernels (csrc/), for what torch_mlu_ops does not provide.

CMake builds them into `libglm5_hal_cambricon_kernels.so` next to this module, only when
Cambricon's Neuware toolchain is found (NEUWARE_HOME, cncc, find_package(BANG)). The library
is loaded lazily with ctypes; when it is absent the adapters that need it decline with
"cambricon kernel not built", so dispatch moves on. Its one entry point is the paged sparse
MLA decode kernel of glm5_hal_kernel_abi.h (the interface, launcher and adapter every kernel
library with that kernel shares: glm5_hal.vendor_ops.dsa); `queue` is a cnrtQueue_t.
"""
from __future__ import annotations

import sys
from pathlib import Path

from glm5_hal.kernel_library import library_path
from glm5_hal.vendor_ops.dsa import DecodeLimits, SparseMlaDecodeLibrary

LIBRARY_NAME = "libglm5_hal_cambricon_kernels.so"


class KernelLibrary(SparseMlaDecodeLibrary):
    """Lazily loaded BANG C kernels; `missing()` says why they cannot be used."""
    # csrc/sparse_mla_decode.mlu: kMaxDqk (NRAM tiling), heads <= 128, int32 cache rows
    decode_limits = DecodeLimits("the BANG C sparse decode kernel", max_dqk=1024, max_heads=128, int32_rows=True)

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path or library_path(sys.modules[__package__].__path__, LIBRARY_NAME),
                         label="cambricon kernel", hint="rebuild glm5_hal with NEUWARE_HOME set and GLM5_HAL_WITH_CAMBRICON=ON")
