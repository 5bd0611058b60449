"""The Hygon DCU backend: glm5_hal ops on a DTK (ROCm-compatible) build of PyTorch, Hygon's
lightop, vLLM's `_C` ops where present, and the backend's own kernels (the shared
CUDA-dialect sources built with hipcc).

A DCU is a `cuda` device to torch, like an NVIDIA or AMD GPU: this backend claims `cuda`
tensors only when `glm5_hal.vendors.cuda_flavor(torch)` says "dcu" (the torch build carries
Hygon's `torch.__hcu_version__` marker), so it never interferes with plain CUDA or ROCm.
`DcuBackend(runtime=None)` wraps the running torch; tests inject an emulator instead
(`DcuBackend(runtime=DcuEmulator("K100_AI"), name="dcu_emu", device_type="cpu")`). Every
instance declares its own adapters, so a real and an emulated backend coexist.

Probe order (the first failing step is the reason; nothing raises):
1. which stack torch is (cuda_flavor): no HIP at all / NVIDIA / AMD ROCm / another
   CUDA look-alike -> "torch build has no HIP/DCU support (torch.version.hip is None)",
   "this is a real NVIDIA GPU stack (...), not a Hygon DCU", "... AMD ...".
2. torch >= arch.MIN_TORCH                               -> "torch X is too old: ..."
3. a DCU is visible                                      -> "no DCU device visible (...)"
4. the device's name and gcnArchName are read            -> "reading the DCU identity failed: ..."
lightop, vLLM's _C and the kernels are optional: an adapter that needs a missing one
declines with the reason. README.md has the op mapping and what has been verified how.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from glm5_hal import Availability, Capabilities, hookimpl
from glm5_hal.vendor_backend import VendorBackend, at_least, dotted
from glm5_hal.vendors import cuda_flavor

from . import arch, kernels, ops
from .arch import Generation
from .runtime import DcuRuntime

_OTHER_STACKS = {
    "iluvatar": "an Iluvatar CoreX stack (torch '+corex' build)",
    "kunlun": "a Kunlunxin stack (torch_xmlir is installed)",
}


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    """What the probe found."""
    generation: Generation | None
    gcn_arch: str
    device_name: str
    device_count: int
    torch_version: str
    hcu_version: str


class DcuBackend(VendorBackend):
    vendor_name = "dcu"
    priority = 100

    def __init__(self, runtime: Any = None, *, name: str | None = None, device_type: str | None = None,
                 priority: int | None = None) -> None:
        super().__init__(runtime, name=name, device_type=device_type, priority=priority)
        self.chip: ChipInfo | None = None
        self.kernels = kernels.dcu_kernels()
        ops.declare(self)

    # -- probing ---------------------------------------------------------------------------
    def load_runtime(self) -> tuple[Any, str]:
        import torch
        return DcuRuntime(torch), ""

    def probe_runtime(self, runtime: Any) -> Availability:
        torch_module = runtime.torch
        version_info = getattr(torch_module, "version", None)
        flavor = cuda_flavor(torch_module)
        if flavor == "none":
            return Availability(False, "torch build has no HIP/DCU support (torch.version.hip is None)")
        if flavor == "cuda":
            return Availability(False, f"this is a real NVIDIA GPU stack (torch.version.cuda = "
                                       f"{getattr(version_info, 'cuda', None)}), not a Hygon DCU")
        if flavor == "rocm":
            return Availability(False, f"this is a real AMD GPU stack (ROCm, torch.version.hip = "
                                       f"{getattr(version_info, 'hip', None)}, no torch.__hcu_version__), not a "
                                       f"Hygon DCU")
        if flavor != "dcu":
            return Availability(False, f"this is {_OTHER_STACKS.get(flavor, flavor)}, not a Hygon DCU")
        version = str(getattr(torch_module, "__version__", ""))
        recent = at_least(version, arch.MIN_TORCH)
        if recent is None:
            return Availability(False, f"the torch version could not be read ({version!r}); glm5_hal needs torch "
                                       f">= {dotted(arch.MIN_TORCH)}")
        if not recent:
            return Availability(False, f"torch {version} is too old: glm5_hal needs torch >= {dotted(arch.MIN_TORCH)}")
        cuda = torch_module.cuda
        try:
            count = int(cuda.device_count()) if cuda.is_available() else 0
        except Exception as exc:
            return Availability(False, f"querying DCU devices failed: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability(False, "no DCU device visible (torch.cuda.device_count() == 0; check "
                                       f"`{self.vendor.smi}` and {self.vendor.visible_devices})")
        try:
            props = cuda.get_device_properties(cuda.current_device())
            device_name, gcn_arch = str(props.name), str(getattr(props, "gcnArchName", ""))
        except Exception as exc:
            return Availability(False, f"reading the DCU identity failed: {type(exc).__name__}: {exc}")
        gen = arch.generation_of(gcn_arch)
        hcu = str(getattr(torch_module, "__hcu_version__", ""))
        self.chip = ChipInfo(gen, gcn_arch.split(":")[0], device_name, count, version, hcu)
        known = gen.gfx if gen is not None else f"{gcn_arch or 'no gcnArchName'}, not in glm5_hal's table"
        return Availability(True, f"{count} x {device_name} ({known}), torch {version} (hcu {hcu})")

    def capabilities(self) -> Capabilities:
        chip = self.chip
        if chip is None:
            return Capabilities(dist_backend=self.vendor.dist_backend)
        gen = chip.generation
        limits = {"gcn_arch": chip.gcn_arch, "devices": chip.device_count,
                  "products": gen.products if gen else "unknown", "dcu_kernels": self.kernels.status(),
                  **ops.OP_LIMITS}
        if gen is not None and gen.unconfirmed:
            limits["unconfirmed"] = gen.unconfirmed
        # RCCL answers to the "nccl" name on ROCm builds of torch
        return Capabilities(dtypes=arch.device_dtypes(gen), dist_backend=self.vendor.dist_backend,
                            device_name=chip.device_name, limits=limits)

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        if self.chip is not None:
            versions.update({"torch": self.chip.torch_version, "hcu": self.chip.hcu_version,
                             "chip": f"{self.chip.device_name} ({self.chip.gcn_arch})"})
        return versions

    # -- used by the adapters --------------------------------------------------------------
    def stream(self, device: Any) -> int:
        """The raw hipStream_t of torch's current stream on `device` (ROCm torch calls it cuda_stream)."""
        return int(self.runtime.torch.cuda.current_stream(device).cuda_stream)


dcu = DcuBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(dcu)
