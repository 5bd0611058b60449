"""The Moore Threads MUSA backend: glm5_hal ops on torch_musa, MUSA FlashMLA and the
backend's own kernels (the shared CUDA-dialect sources built with mcc).

`MusaBackend(runtime=None)` imports torch_musa lazily in its probe; tests inject an emulator
instead (`MusaBackend(runtime=MusaEmulator("S4000"), name="musa_emu", device_type="cpu")`).
Every instance declares its own adapters (closures over the instance), so a real and an
emulated backend coexist. Registered through the `glm5_hal.backends` entry point.

Probe order (the first failing step is the reason; nothing raises):
1. torch_musa is installed (found without importing it)  -> "bridge torch_musa not installed"
2. torch_musa imports; a missing MUSA library is named    -> "runtime library missing: ..."
3. torch_musa >= arch.MIN_TORCH_MUSA                      -> "torch_musa X is too old: ..."
4. a MUSA device is visible                              -> "no MUSA device visible (...)"
5. the device's architecture (capability) is known        -> "unsupported MUSA architecture ..."
README.md has the op mapping and what has been verified how.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from glm5_hal import Availability, Capabilities, hookimpl
from glm5_hal.vendor_backend import VendorBackend, at_least, dotted, import_bridge

from . import arch, kernels, ops
from .arch import Generation
from .runtime import MusaRuntime


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    """What the probe found."""
    generation: Generation
    device_name: str
    device_count: int
    torch_musa_version: str
    mudnn_version: int | None


class MusaBackend(VendorBackend):
    vendor_name = "musa"
    priority = 100

    def __init__(self, runtime: Any = None, *, name: str | None = None, device_type: str | None = None,
                 priority: int | None = None) -> None:
        super().__init__(runtime, name=name, device_type=device_type, priority=priority)
        self.chip: ChipInfo | None = None
        self.kernels = kernels.musa_kernels()
        ops.declare(self)

    # -- probing ---------------------------------------------------------------------------
    def load_runtime(self) -> tuple[Any, str]:
        bridge, reason = import_bridge(self.vendor)
        if bridge is None:
            return None, reason
        import torch
        if not hasattr(torch, "musa"):
            return None, ("torch_musa imported but did not register the musa device (torch.musa is missing); "
                          "is this torch_musa built for this torch?")
        return MusaRuntime(torch, bridge), ""

    def probe_runtime(self, runtime: Any) -> Availability:
        version = str(getattr(runtime, "__version__", ""))
        recent = at_least(version, arch.MIN_TORCH_MUSA)
        minimum = f"the adapters use the torch_musa {dotted(arch.MIN_TORCH_MUSA)} API"
        if recent is None:
            return Availability(False, f"the torch_musa version could not be read ({version!r}); {minimum}")
        if not recent:
            return Availability(False, f"torch_musa {version} is too old: {minimum}")
        musa = runtime.musa
        try:
            count = int(musa.device_count()) if musa.is_available() else 0
        except Exception as exc:  # driver errors surface here on broken installs
            return Availability(False, f"querying MUSA devices failed: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability(False, "no MUSA device visible (torch.musa.device_count() == 0; check "
                                       f"`{self.vendor.smi}` and {self.vendor.visible_devices})")
        try:
            device = musa.current_device()
            capability = tuple(int(v) for v in musa.get_device_capability(device))
            device_name = str(musa.get_device_name(device))
        except Exception as exc:
            return Availability(False, f"reading the MUSA device identity failed: {type(exc).__name__}: {exc}")
        gen = arch.generation_of(capability)
        if gen is None:
            major, minor = (capability + (0, 0))[:2]
            return Availability(False, f"unsupported MUSA architecture mp_{major}{minor} ({device_name}); the "
                                       f"musa backend supports {arch.supported_archs()}")
        self.chip = ChipInfo(gen, device_name, count, version, runtime.mudnn_version())
        return Availability(True, f"{count} x {device_name} ({gen.arch}), torch_musa {version}")

    def capabilities(self) -> Capabilities:
        chip = self.chip
        if chip is None:  # only asked after a successful probe
            return Capabilities(dist_backend=self.vendor.dist_backend)
        gen = chip.generation
        limits = {"arch": gen.arch, "cards": gen.cards, "devices": chip.device_count, "bf16": gen.bf16,
                  "fp8": gen.fp8, "flash_mla_sparse": gen.flash_mla_sparse, "mudnn": chip.mudnn_version,
                  "musa_kernels": self.kernels.status(), **ops.OP_LIMITS}
        if not gen.mccl:
            limits["dist"] = f"MCCL is not provided for {gen.cards} (torch_musa README): no multi-card collectives"
        return Capabilities(dtypes=arch.device_dtypes(gen), dist_backend=self.vendor.dist_backend if gen.mccl else None,
                            device_name=chip.device_name, limits=limits)

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        if self.chip is not None:
            versions.update({"torch_musa": self.chip.torch_musa_version,
                             "chip": f"{self.chip.device_name} ({self.chip.generation.arch})"})
            if self.chip.mudnn_version is not None:
                versions["muDNN"] = str(self.chip.mudnn_version)
        return versions

    # -- used by the adapters --------------------------------------------------------------
    @property
    def generation(self) -> Generation | None:
        return self.chip.generation if self.chip is not None else None

    def stream(self, device: Any) -> int:
        """The raw musaStream_t of the current stream on `device`, for the kernels."""
        return int(self.runtime.musa.current_stream(device).musa_stream)


musa = MusaBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(musa)
