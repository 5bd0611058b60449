"""The Enflame GCU backend: glm5_hal ops on torch_gcu and the kernels vllm-gcu registers for
the `gcu` device (PrivateUse1).

`EnflameBackend(runtime=None)` imports torch_gcu lazily in its probe; tests inject an
emulator instead (`EnflameBackend(runtime=GcuEmulator("gcu400"), name="enflame_emu",
device_type="cpu")`). Every instance binds the adapter table (ops.ADAPTERS) to itself, so a
real and an emulated backend coexist. Registered through the `glm5_hal.backends` entry point.

Probe order (glm5_hal.vendor_backend's skeleton over the hooks below; the first failing step
is the reason; nothing raises) -- the detection vllm-gcu's platform does (vllm_gcu/gcu.py
@7b5aaca9: `import torch_gcu`, then torch.gcu):
1. torch_gcu is installed (found without importing it)  -> "bridge torch_gcu not installed"
2. torch_gcu imports; a missing TopsRider library is named -> "runtime library missing: ..."
3. torch.gcu exists                                       -> "torch_gcu imported but did not register ..."
4. torch_gcu >= chips.MIN_TORCH_GCU                       -> "torch_gcu X is too old: ..."
5. a GCU is visible                                       -> "no GCU visible (...)"
6. the capability is a known generation                   -> "unsupported GCU generation ..."
7. the versioned behaviour (chips.BEHAVIOURS: vllm-gcu's op schemas) is chosen from the
   installed vllm-gcu; a version outside the range read narrows the backend.
Nothing CUDA is consulted: torch_gcu.transfer_to_gcu makes torch.cuda answer for GCUs, so a
GCU is never taken for a `cuda` stack here, and glm5_hal.vendors.identify() checks `torch.gcu`
before any CUDA flavor. README.md has the op mapping and what has been verified how.
"""
from __future__ import annotations

from typing import Any

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import ChipInfo, Declined, VendorBackend, dotted, module_version, require_version

from . import chips, ops
from .runtime import GcuRuntime


class EnflameBackend(VendorBackend):
    vendor_name = "enflame"
    adapters = ops.ADAPTERS
    behaviours = chips.BEHAVIOURS
    op_limits = ops.OP_LIMITS
    device_noun = "GCU"
    device_count_call = "torch.gcu.device_count()"

    # -- probe hooks -----------------------------------------------------------------------
    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        import torch
        if not hasattr(torch, "gcu"):
            return None, ("torch_gcu imported but did not register the gcu device (torch.gcu is missing); "
                          "is this torch_gcu built for this torch?")
        return GcuRuntime(torch, bridge), ""

    def check_versions(self, runtime: Any) -> dict[str, str]:
        if getattr(runtime, "gcu", None) is None:
            raise Declined("torch_gcu imported but did not register the gcu device (torch.gcu is missing); "
                           "is this torch_gcu built for this torch?")
        version = require_version("torch_gcu", module_version(runtime), chips.MIN_TORCH_GCU,
                                  f"vllm-gcu's ops need torch_gcu {dotted(chips.MIN_TORCH_GCU)} (PyTorch 2.7)")
        vllm_gcu = runtime.package_version(chips.VLLM_GCU)
        return {"torch_gcu": version, **({chips.VLLM_GCU: vllm_gcu} if vllm_gcu else {})}

    def devices(self, runtime: Any) -> Any:
        return runtime.gcu

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        gcu = runtime.gcu
        device = gcu.current_device()
        capability = tuple(int(v) for v in gcu.get_device_capability(device))
        name = str(gcu.get_device_name(device))
        gen = chips.generation_of(capability)
        if gen is None:
            raise Declined(f"unsupported GCU generation (torch.gcu capability {dotted(capability)}, {name}); "
                           f"the enflame backend supports {chips.supported()}")
        summary = f"{count} x {name} ({gen.arch}), torch_gcu {versions['torch_gcu']}" + (
            f", vllm_gcu {versions[chips.VLLM_GCU]}" if chips.VLLM_GCU in versions else "")
        return ChipInfo(name, count, summary, generation=gen, identity=f"capability {dotted(capability)}",
                        versions=versions, facts={"arch": gen.arch})

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return chips.device_dtypes(chip.generation)

    def chip_limits(self, chip: ChipInfo) -> dict:
        gen = chip.generation
        return {"products": gen.products, "fp8": gen.fp8,
                "own kernels": "none: vllm-gcu's kernels are TopsCC (.tops) sources; the CUDA-dialect ones do not "
                               "build"}


enflame = EnflameBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(enflame)
