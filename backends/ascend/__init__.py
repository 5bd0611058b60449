"""The Huawei Ascend backend: glm5_hal ops on `torch_npu` (CANN) fused ops.

`AscendBackend(runtime=None)` imports `torch_npu` lazily, after checking that the CANN
libraries it links against can be loaded, so a missing toolkit is a specific reason rather
than an exception. Tests inject an emulator instead (`AscendBackend(runtime=NpuEmulator(),
name="ascend_emu", device_type="cpu")`); every instance declares its own adapters, so a real
and an emulated backend coexist. Registered through the `glm5_hal.backends` entry point.
See README.md for the op mapping and what has been verified how.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

from glm5_hal import Availability, Capabilities, hookimpl
from glm5_hal.vendor_backend import VendorBackend, at_least, dotted, describe_import_failure, import_bridge
from glm5_hal.vendors import Vendor, installed

from . import chips, kernels, ops
from .chips import Generation


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    """What the probe found: the chip generation and the software versions."""
    generation: Generation
    soc_version: int
    device_name: str
    device_count: int
    cann_version: str
    torch_npu_version: str


class AscendBackend(VendorBackend):
    vendor_name = "ascend"
    priority = 100

    def __init__(self, runtime: Any = None, *, name: str | None = None, device_type: str | None = None,
                 priority: int | None = None) -> None:
        super().__init__(runtime, name=name, device_type=device_type, priority=priority)
        self.chip: ChipInfo | None = None
        self.kernels = kernels.KernelLibrary()
        ops.declare(self)

    # -- probing ---------------------------------------------------------------------------
    def load_runtime(self) -> tuple[Any, str]:
        if not installed("torch_npu"):
            return None, "bridge torch_npu not installed"
        missing = missing_runtime_library(self.vendor)
        if missing:
            return None, missing
        return import_bridge(self.vendor)

    def probe_runtime(self, runtime: Any) -> Availability:
        version = str(getattr(runtime, "__version__", ""))
        if not at_least(version, chips.MIN_TORCH_NPU):
            return Availability(False, f"torch_npu {version or '(no __version__)'} is too old: the adapters "
                                       f"use the torch_npu {dotted(chips.MIN_TORCH_NPU)} op schemas")
        npu = getattr(runtime, "npu", None)
        try:
            count = int(npu.device_count()) if npu.is_available() else 0
        except Exception as exc:  # driver errors surface here on broken installs
            return Availability(False, f"querying NPU devices failed: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability(False, "no NPU device visible (torch_npu.npu.device_count() == 0; check "
                                       f"`{self.vendor.smi} info` and {self.vendor.visible_devices})")
        try:
            cann = str(npu.utils.get_cann_version(module="CANN"))
        except Exception as exc:
            return Availability(False, f"reading the CANN version failed: {type(exc).__name__}: {exc}")
        cann_ok = at_least(cann, chips.MIN_CANN)
        minimum = f"the DSA kernels need CANN >= {dotted(chips.MIN_CANN)}"
        if cann_ok is None:
            return Availability(False, f"the CANN version could not be read ({cann!r}); {minimum}")
        if not cann_ok:
            return Availability(False, f"CANN {cann} is too old: {minimum}")
        try:
            soc = int(npu.get_soc_version())
            device_name = str(npu.get_device_name())
        except Exception as exc:
            return Availability(False, f"reading the chip identity failed: {type(exc).__name__}: {exc}")
        gen = chips.generation_of(soc)
        if gen is None:
            return Availability(False, f"unsupported chip {device_name} (soc_version {soc}); the ascend "
                                       f"backend supports {chips.supported_socs()}")
        self.chip = ChipInfo(gen, soc, device_name, count, cann, version)
        return Availability(True, f"{count} x {device_name} ({gen.label}), torch_npu {version}, CANN {cann}")

    def capabilities(self) -> Capabilities:
        chip = self.chip
        if chip is None:  # only asked after a successful probe
            return Capabilities(dist_backend=self.vendor.dist_backend)
        gen = chip.generation
        return Capabilities(
            dtypes=chips.device_dtypes(gen), dist_backend=self.vendor.dist_backend,
            device_name=chip.device_name,
            limits={"generation": gen.label, "soc_version": chip.soc_version, "devices": chip.device_count,
                    "fp8": gen.fp8, "indexer_key_quantisation": gen.indexer_key_quant,
                    "ascend_c_kernels": self.kernels.status(), **ops.OP_LIMITS})

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        if self.chip is not None:
            versions.update({"torch_npu": self.chip.torch_npu_version, "CANN": self.chip.cann_version,
                             "chip": f"{self.chip.device_name} (soc {self.chip.soc_version})"})
        return versions

    # -- used by the adapters --------------------------------------------------------------
    def fp8_declined(self) -> str | None:
        """None when the chip computes in FP8, else the capability reason."""
        gen = self.chip.generation if self.chip is not None else None
        if gen is not None and gen.fp8:
            return None
        where = f"{self.chip.device_name} ({gen.label})" if gen is not None else "this chip"
        return f"{where} has no FP8 (float8_e4m3fn); FP8 needs an Ascend 950"


def missing_runtime_library(vendor: Vendor) -> str | None:
    """Loads the CANN libraries torch_npu links against; the reason naming the first that
    cannot be loaded, or None. Cheaper and more precise than importing torch_npu."""
    for library in chips.CANN_LIBRARIES:
        try:
            ctypes.CDLL(library)
        except OSError as exc:
            if "cannot open shared object" in str(exc):
                return describe_import_failure(vendor, exc)
            return f"runtime library {library} does not load: {exc}"
    return None


ascend = AscendBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(ascend)
