"""The Huawei Ascend backend: glm5_hal ops on `torch_npu` (CANN) fused ops.

`AscendBackend(runtime=None)` imports `torch_npu` lazily, after checking that the CANN
libraries it links against can be loaded, so a missing toolkit is a specific reason rather
than an exception. Tests inject an emulator instead (`AscendBackend(runtime=NpuEmulator(),
name="ascend_emu", device_type="cpu")`); every instance binds the adapter table
(ops.ADAPTERS) to itself, so a real and an emulated backend coexist. Registered through the
`glm5_hal.backends` entry point. The probe is glm5_hal.vendor_backend's skeleton over the
hooks below.
See README.md for the op mapping and what has been verified how.
"""
from __future__ import annotations

import os
from typing import Any

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import ChipInfo, Declined, VendorBackend, dotted, module_version, require_version

from . import chips, kernels, ops, versions


class AscendBackend(VendorBackend):
    vendor_name = "ascend"
    adapters = ops.ADAPTERS
    op_limits = ops.OP_LIMITS
    behaviours = versions.BEHAVIOURS
    kernels_limit = "ascend_c_kernels"
    device_noun = "NPU device"
    device_count_call = "torch_npu.npu.device_count()"
    device_check = "`{smi} info` and {visible}"

    def __init__(self, runtime: Any = None, *, vendor_precision: bool | None = None, **kwargs: Any) -> None:
        """`vendor_precision`: accept where the vendor kernels are documented to compute more
        coarsely than the op contract (ops.PRECISION); default from GLM5_HAL_ASCEND_VENDOR_PRECISION
        ("1"), else off: those calls are declined, saying why."""
        if vendor_precision is None:
            text = os.environ.get("GLM5_HAL_ASCEND_VENDOR_PRECISION", "").strip()
            if text not in ("", "0", "1"):
                raise ValueError(f"GLM5_HAL_ASCEND_VENDOR_PRECISION: expected 0 or 1, got {text!r}")
            vendor_precision = text == "1"
        self.vendor_precision = vendor_precision
        super().__init__(runtime, **kwargs)

    def default_kernels(self) -> Any:
        return kernels.KernelLibrary()

    # -- probe hooks -----------------------------------------------------------------------
    def runtime_libraries(self) -> tuple[str, ...]:
        # loaded before importing torch_npu: cheaper and more precise than its import error
        return chips.CANN_LIBRARIES

    def check_versions(self, runtime: Any) -> dict[str, str]:
        version = require_version("torch_npu", module_version(runtime), chips.MIN_TORCH_NPU,
                                  f"each torch_npu requires its own torch release and glm5_hal needs torch >= "
                                  f"{dotted(chips.MIN_TORCH_NPU)}")
        try:
            cann = str(runtime.npu.utils.get_cann_version(module="CANN"))
        except Exception as exc:
            raise Declined(f"reading the CANN version failed: {type(exc).__name__}: {exc}") from None
        # CANN decides the attention kernels' rules (versions.py): a CANN outside the releases
        # they were read from narrows the DSA adapters instead of refusing the backend
        return {"torch_npu": version, "CANN": cann}

    def devices(self, runtime: Any) -> Any:
        return runtime.npu

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        soc = int(runtime.npu.get_soc_version())
        device_name = str(runtime.npu.get_device_name())
        gen = chips.generation_of(soc)
        if gen is None:
            raise Declined(f"unsupported chip {device_name} (soc_version {soc}); the ascend backend supports "
                           f"{chips.supported_socs()}")
        summary = (f"{count} x {device_name} ({gen.label}), torch_npu {versions['torch_npu']}, "
                   f"CANN {versions['CANN']}")
        return ChipInfo(device_name, count, summary, generation=gen, identity=f"soc {soc}", versions=versions,
                        facts={"soc_version": soc})

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return chips.device_dtypes(chip.generation)

    def chip_limits(self, chip: ChipInfo) -> dict:
        gen = chip.generation
        return {"generation": gen.label, "fp8": gen.fp8, "indexer_key_quantisation": gen.indexer_key_quant}

    # -- used by the adapters --------------------------------------------------------------
    def stream(self, device: Any) -> int:
        """The raw aclrtStream of torch_npu's current stream on `device`, for the kernels."""
        return self.runtime.npu.current_stream(device).npu_stream


ascend = AscendBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(ascend)
