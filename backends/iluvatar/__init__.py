"""The Iluvatar CoreX backend: glm5_hal ops on a CoreX build of PyTorch, Iluvatar's ixformer,
FlagGems' Iluvatar kernels and the backend's own kernels (the shared CUDA-dialect sources built
by CoreX's clang++).

A CoreX GPU is a `cuda` device to torch, like an NVIDIA GPU, a Hygon DCU or (in its CUDA mode)
a Kunlun XPU: this backend claims `cuda` tensors only when the stack is identified as CoreX the
way FlagGems identifies it (flagos-ai/FlagGems src/flag_gems/runtime/backend/device_finder.py
@ed2508bc): the torch attribute `torch.corex` (runtime/common.py _VENDOR_TORCH_ATTR; also the
'+corex' suffix of the vendor's torch wheels), else -- FlagGems' fallback -- device 0 is not an
NVIDIA device and the vendor's query tool `ixsmi` runs. `IluvatarBackend(runtime=None)` wraps
the running torch; tests inject an emulator instead. Every instance binds the adapter table
(ops.ADAPTERS) to itself.

Probe order (glm5_hal.vendor_backend's skeleton over the hooks below; the first failing step is
the reason; nothing raises):
1. which stack torch is: an Enflame torch (torch.gcu: torch_gcu's transfer_to_gcu makes
   torch.cuda answer for GCUs), a Hygon DCU, a Kunlun or an AMD stack, no CUDA at all, or a
   CUDA torch without the CoreX marker whose device 0 is NVIDIA's or where `ixsmi` does not
   run -> "this is ..., not Iluvatar CoreX"
2. torch >= chips.MIN_TORCH                              -> "torch X is too old: ..."
3. a CoreX GPU is visible                                -> "no CoreX GPU visible (...)"
4. the device's name is read (products in chips.PRODUCTS; others usable, reported as such)
5. the versioned behaviours (chips.BEHAVIOURS) are chosen from ixformer's and FlagGems'
   versions; one outside its verified range narrows the backend.
ixformer, FlagGems and the kernels are optional: an adapter that needs a missing one declines
with the reason. README.md has the op mapping and what has been verified how.
"""
from __future__ import annotations

from typing import Any

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import ChipInfo, Declined, VendorBackend, dotted, module_version, require_version
from glm5_hal.vendors import cuda_flavor

from . import chips, kernels, ops
from .runtime import IluvatarRuntime

_OTHER_STACKS = {
    "enflame": "an Enflame GCU stack (torch.gcu is set; torch_gcu's transfer_to_gcu makes torch.cuda answer for "
               "GCUs)",
    "dcu": "a Hygon DCU stack (torch.__hcu_version__)",
    "kunlun": "a Kunlunxin stack (torch_xmlir is installed)",
    "rocm": "an AMD ROCm stack (torch.version.hip is set)",
}


class IluvatarBackend(VendorBackend):
    vendor_name = "iluvatar"
    adapters = ops.ADAPTERS
    behaviours = chips.BEHAVIOURS
    op_limits = ops.OP_LIMITS
    kernels_limit = "corex_kernels"
    device_noun = "CoreX GPU"
    device_count_call = "torch.cuda.device_count()"

    def default_kernels(self) -> Any:
        return kernels.iluvatar_kernels()

    # -- probe hooks -----------------------------------------------------------------------
    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        import torch
        return IluvatarRuntime(torch), ""

    def check_versions(self, runtime: Any) -> dict[str, str]:
        torch_module = runtime.torch
        identified_by = self._identify_stack(runtime)
        version = require_version("torch", module_version(torch_module), chips.MIN_TORCH,
                                  f"glm5_hal needs torch >= {dotted(chips.MIN_TORCH)}")
        found = {name: runtime.package_version(name) for name in (chips.IXFORMER, chips.FLAG_GEMS)}
        return {"torch": version, "identified by": identified_by, **{k: v for k, v in found.items() if v}}

    @staticmethod
    def _identify_stack(runtime: Any) -> str:
        """How the stack was identified as CoreX, or Declined saying what it is instead."""
        torch_module = runtime.torch
        flavor = cuda_flavor(torch_module)
        if flavor == "iluvatar":
            return "torch.corex" if hasattr(torch_module, "corex") else "torch '+corex' build"
        if flavor == "none":
            raise Declined("torch build has no CUDA-compatible device support (torch.version.cuda is None), so no "
                           "CoreX")
        if flavor != "cuda":
            raise Declined(f"this is {_OTHER_STACKS.get(flavor, flavor)}, not Iluvatar CoreX")
        # a CUDA torch without the CoreX marker: FlagGems' fallback, NVIDIA's device name first
        cuda = torch_module.cuda
        try:
            name = str(cuda.get_device_name(0)) if cuda.is_available() and cuda.device_count() > 0 else ""
        except Exception:  # a broken driver: ixsmi decides
            name = ""
        if "NVIDIA" in name.upper():
            raise Declined(f"this is a real NVIDIA GPU stack (device 0 is {name!r}, torch has no torch.corex), "
                           "not Iluvatar CoreX")
        ran, said = runtime.query_tool()
        if not ran:
            raise Declined(f"torch has no CoreX marker (torch.corex, '+corex'; torch.version.cuda = "
                           f"{getattr(torch_module.version, 'cuda', None)}) and {said}: not Iluvatar CoreX")
        return f"ixsmi ({said})"

    def devices(self, runtime: Any) -> Any:
        return runtime.torch.cuda

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        cuda = runtime.torch.cuda
        name = str(cuda.get_device_name(cuda.current_device()))
        product = chips.product_of(name)
        known = product.name if product is not None else "not in glm5_hal's table"
        summary = f"{count} x {name} ({known}), torch {versions['torch']}" + "".join(
            f", {package} {versions[package]}" for package in (chips.IXFORMER, chips.FLAG_GEMS) if package in versions)
        return ChipInfo(name, count, summary, generation=product, identity=versions["identified by"],
                        versions=versions, facts={"product": known})

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return chips.device_dtypes(chip.generation)

    def chip_limits(self, chip: ChipInfo) -> dict:
        product = chip.generation
        limits = {"fp64": False}  # FlagGems' descriptor: fp64_enabled=False
        if product is not None and product.unconfirmed:
            limits["unconfirmed"] = product.unconfirmed
        return limits

    # -- used by the adapters --------------------------------------------------------------
    def stream(self, device: Any) -> int:
        """The raw stream of torch's current stream on `device` (CoreX keeps CUDA's names)."""
        return int(self.runtime.torch.cuda.current_stream(device).cuda_stream)


iluvatar = IluvatarBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(iluvatar)
