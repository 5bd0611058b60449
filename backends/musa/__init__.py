"""The Moore Threads MUSA backend: glm5_hal ops on torch_musa, MooreThreads' mate (FlashMLA,
MoE and FP8 GEMMs) and the backend's own kernels (the shared CUDA-dialect sources built
with mcc).

`MusaBackend(runtime=None)` imports torch_musa lazily in its probe; tests inject an emulator
instead (`MusaBackend(runtime=MusaEmulator("S4000"), name="musa_emu", device_type="cpu")`).
Every instance binds the adapter table (ops.ADAPTERS) to itself, so a real and an emulated
backend coexist. Registered through the `glm5_hal.backends` entry point.

Probe order (glm5_hal.vendor_backend's skeleton over the hooks below; the first failing step
is the reason; nothing raises):
1. torch_musa is installed (found without importing it)  -> "bridge torch_musa not installed"
2. torch_musa imports; a missing MUSA library is named    -> "runtime library missing: ..."
3. torch_musa >= arch.MIN_TORCH_MUSA                      -> "torch_musa X is too old: ..."
4. a MUSA device is visible                              -> "no MUSA device visible (...)"
5. the device's architecture (capability) is known        -> "unsupported MUSA architecture ..."
6. the versioned behaviours (arch.BEHAVIOURS) are chosen from the installed torch_musa and
   mate; one outside its verified range narrows the backend ("narrowed to what is verified").
README.md has the op mapping and what has been verified how, against which versions.
"""
from __future__ import annotations

from typing import Any

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import ChipInfo, Declined, VendorBackend, dotted, module_version, require_version

from . import arch, kernels, ops
from .runtime import MusaRuntime


class MusaBackend(VendorBackend):
    vendor_name = "musa"
    adapters = ops.ADAPTERS
    behaviours = arch.BEHAVIOURS
    op_limits = ops.OP_LIMITS
    kernels_limit = "musa_kernels"
    device_noun = "MUSA device"
    device_count_call = "torch.musa.device_count()"

    def default_kernels(self) -> Any:
        return kernels.musa_kernels()

    # -- probe hooks -----------------------------------------------------------------------
    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        import torch
        if not hasattr(torch, "musa"):
            return None, ("torch_musa imported but did not register the musa device (torch.musa is missing); "
                          "is this torch_musa built for this torch?")
        return MusaRuntime(torch, bridge), ""

    def check_versions(self, runtime: Any) -> dict[str, str]:
        version = require_version("torch_musa", module_version(runtime), arch.MIN_TORCH_MUSA,
                                  f"the adapters use the torch_musa {dotted(arch.MIN_TORCH_MUSA)} API")
        mate = runtime.package_version(arch.MATE)
        return {"torch_musa": version, **({arch.MATE: mate} if mate else {})}

    def devices(self, runtime: Any) -> Any:
        return runtime.musa

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        musa = runtime.musa
        device = musa.current_device()
        capability = tuple(int(v) for v in musa.get_device_capability(device))
        device_name = str(musa.get_device_name(device))
        gen = arch.generation_of(capability)
        if gen is None:
            major, minor = (capability + (0, 0))[:2]
            raise Declined(f"unsupported MUSA architecture mp_{major}{minor} ({device_name}); the "
                           f"musa backend supports {arch.supported_archs()}")
        mudnn = runtime.mudnn_version()
        summary = f"{count} x {device_name} ({gen.arch}), torch_musa {versions['torch_musa']}" + (
            f", mate {versions[arch.MATE]}" if arch.MATE in versions else "")
        return ChipInfo(device_name, count, summary, generation=gen, identity=gen.arch,
                        versions={**versions, **({"muDNN": str(mudnn)} if mudnn is not None else {})},
                        facts={"mudnn": mudnn})

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return arch.device_dtypes(chip.generation)

    def chip_limits(self, chip: ChipInfo) -> dict:
        gen = chip.generation
        limits = {"arch": gen.arch, "cards": gen.cards, "bf16": gen.bf16, "fp8": gen.fp8, "mate": gen.mate}
        if not gen.mccl:
            limits["dist"] = f"MCCL is not provided for {gen.cards} (torch_musa README): no multi-card collectives"
        return limits

    def chip_dist_backend(self, chip: ChipInfo) -> str | None:
        return self.vendor.dist_backend if chip.generation.mccl else None

    # -- used by the adapters --------------------------------------------------------------
    def stream(self, device: Any) -> int:
        """The raw musaStream_t of the current stream on `device`, for the kernels."""
        return int(self.runtime.musa.current_stream(device).musa_stream)


musa = MusaBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(musa)
