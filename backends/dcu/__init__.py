"""The Hygon DCU backend: glm5_hal ops on a DTK (ROCm-compatible) build of PyTorch, Hygon's
lightop, vLLM's `_C` ops where present, and the backend's own kernels (the shared
CUDA-dialect sources built with hipcc).

A DCU is a `cuda` device to torch, like an NVIDIA or AMD GPU: this backend claims `cuda`
tensors only when `glm5_hal.vendors.cuda_flavor(torch)` says "dcu" (the torch build carries
Hygon's `torch.__hcu_version__` marker), so it never interferes with plain CUDA or ROCm.
`DcuBackend(runtime=None)` wraps the running torch; tests inject an emulator instead
(`DcuBackend(runtime=DcuEmulator("K100_AI"), name="dcu_emu", device_type="cpu")`). Every
instance binds the adapter table (ops.ADAPTERS) to itself, so a real and an emulated backend
coexist.

Probe order (glm5_hal.vendor_backend's skeleton over the hooks below; the first failing step
is the reason; nothing raises):
1. which stack torch is (cuda_flavor): no HIP at all / NVIDIA / AMD ROCm / another
   CUDA look-alike -> "torch build has no HIP/DCU support (torch.version.hip is None)",
   "this is a real NVIDIA GPU stack (...), not a Hygon DCU", "... AMD ...".
2. torch >= arch.MIN_TORCH                               -> "torch X is too old: ..."
3. a DCU is visible                                      -> "no DCU device visible (...)"
4. the device's name and gcnArchName are read            -> "reading the DCU identity failed: ..."
5. the versioned behaviours (arch.BEHAVIOURS: lightop's module layout) are chosen from the
   installed lightop; a version outside the verified range narrows the backend
lightop, vLLM's _C and the kernels are optional: an adapter that needs a missing one
declines with the reason. README.md has the op mapping and what has been verified how.
"""
from __future__ import annotations

from typing import Any

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import ChipInfo, Declined, VendorBackend, dotted, module_version, require_version
from glm5_hal.vendors import cuda_flavor

from . import arch, kernels, ops
from .runtime import DcuRuntime

_OTHER_STACKS = {
    "iluvatar": "an Iluvatar CoreX stack (torch '+corex' build)",
    "kunlun": "a Kunlunxin stack (torch_xmlir is installed)",
    "enflame": "an Enflame GCU stack (torch.gcu is set)",
}


class DcuBackend(VendorBackend):
    vendor_name = "dcu"
    adapters = ops.ADAPTERS
    behaviours = arch.BEHAVIOURS
    op_limits = ops.OP_LIMITS
    kernels_limit = "dcu_kernels"
    device_noun = "DCU device"
    device_count_call = "torch.cuda.device_count()"

    def __init__(self, runtime: Any = None, **options: Any) -> None:
        super().__init__(runtime, **options)
        #: (device type, dtype) -> why torch._grouped_mm cannot run it (None: it can), found once
        self.grouped_mm_verdicts: dict[tuple, str | None] = {}

    def default_kernels(self) -> Any:
        return kernels.dcu_kernels()

    # -- probe hooks -----------------------------------------------------------------------
    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        import torch
        return DcuRuntime(torch), ""

    def check_versions(self, runtime: Any) -> dict[str, str]:
        torch_module = runtime.torch
        version_info = getattr(torch_module, "version", None)
        flavor = cuda_flavor(torch_module)
        if flavor == "none":
            raise Declined("torch build has no HIP/DCU support (torch.version.hip is None)")
        if flavor == "cuda":
            raise Declined(f"this is a real NVIDIA GPU stack (torch.version.cuda = "
                           f"{getattr(version_info, 'cuda', None)}), not a Hygon DCU")
        if flavor == "rocm":
            raise Declined(f"this is a real AMD GPU stack (ROCm, torch.version.hip = "
                           f"{getattr(version_info, 'hip', None)}, no torch.__hcu_version__), not a Hygon DCU")
        if flavor != "dcu":
            raise Declined(f"this is {_OTHER_STACKS.get(flavor, flavor)}, not a Hygon DCU")
        version = require_version("torch", module_version(torch_module), arch.MIN_TORCH,
                                  f"glm5_hal needs torch >= {dotted(arch.MIN_TORCH)}")
        lightop = runtime.package_version(arch.LIGHTOP)
        return {"torch": version, "hcu": str(getattr(torch_module, "__hcu_version__", "")),
                **({arch.LIGHTOP: lightop} if lightop else {})}

    def devices(self, runtime: Any) -> Any:
        return runtime.torch.cuda

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        cuda = runtime.torch.cuda
        props = cuda.get_device_properties(cuda.current_device())
        device_name, gcn_arch = str(props.name), str(getattr(props, "gcnArchName", ""))
        gen = arch.generation_of(gcn_arch)
        known = gen.gfx if gen is not None else f"{gcn_arch or 'no gcnArchName'}, not in glm5_hal's table"
        summary = f"{count} x {device_name} ({known}), torch {versions['torch']} (hcu {versions['hcu']})" + (
            f", lightop {versions[arch.LIGHTOP]}" if arch.LIGHTOP in versions else "")
        gfx = gcn_arch.split(":")[0]
        return ChipInfo(device_name, count, summary, generation=gen, identity=gfx, versions=versions,
                        facts={"gcn_arch": gfx})

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return arch.device_dtypes(chip.generation)

    def chip_limits(self, chip: ChipInfo) -> dict:
        # RCCL answers to the "nccl" name on ROCm builds of torch (the vendor's dist_backend)
        gen = chip.generation
        limits = {"products": gen.products if gen else "unknown"}
        if gen is not None and gen.unconfirmed:
            limits["unconfirmed"] = gen.unconfirmed
        return limits

    # -- used by the adapters --------------------------------------------------------------
    def stream(self, device: Any) -> int:
        """The raw hipStream_t of torch's current stream on `device` (ROCm torch calls it cuda_stream)."""
        return int(self.runtime.torch.cuda.current_stream(device).cuda_stream)


dcu = DcuBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(dcu)
