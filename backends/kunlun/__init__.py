"""The Kunlunxin backend: glm5_hal ops on Kunlun3 (P800) under xpytorch, through
`kunlun_ops`, the vLLM-Kunlun kernels in `torch.ops._C` and `xspeedgate_ops`.

xpytorch runs the XPU in CUDA-compatible mode: tensors live on `cuda` devices, and
torch.distributed's "nccl" is BKCL underneath. So this backend registers for device type
`cuda` and must claim it only when the cuda stack really is Kunlun: glm5_hal.vendors'
cuda_flavor() says "kunlun" (torch_xmlir installed, no DCU/Iluvatar marker on torch), and
device 0 is not an NVIDIA GPU. `KunlunBackend(runtime=XpuEmulator(), name="kunlun_emu",
device_type="cpu")` runs the same adapters against the emulator in tests; every instance
binds the adapter table (ops.ADAPTERS) to itself, so real and emulated backends coexist.

Probe order (glm5_hal.vendor_backend's skeleton over the hooks below; the first failing step
is the reason; nothing here raises or exits):
  1. the bridge is installed (`torch_xmlir`, found without importing it)
  2. the cuda stack is Kunlun's (vendors.cuda_flavor(torch) == "kunlun")
  3. `import torch_xmlir` (guarded; a missing XRE library such as libxpurt.so is named)
  4. `import kunlun_ops` (or its former name xtorch_ops), the fused-op library
     (`xspeedgate_ops` is optional: without it only hadamard_transform declines)
  5. torch is at least chips.MIN_TORCH (xpytorch's CUDA-compatible mode)
  6. an XPU is visible (torch.cuda.device_count() > 0)
  7. device 0 is a Kunlun3-class XPU: not an NVIDIA GPU, not a Kunlun2 (R200)
  8. the versioned behaviours (chips.BEHAVIOURS) are chosen from the installed vLLM-Kunlun
     (whose `_C` ops the MoE adapters call); a version outside the verified range narrows
     the backend ("narrowed to what is verified")
"""
from __future__ import annotations

from typing import Any

import torch

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import (ChipInfo, Declined, VendorBackend, distribution_version, dotted, import_first,
                                     module_version, require_version)
from glm5_hal.vendors import cuda_flavor

from . import chips, kernels, ops

FUSED_OPS_MODULES = ("kunlun_ops", "xtorch_ops")   # current name first, then the older wheel's
SPEEDGATE_MODULE = "xspeedgate_ops"


class XpuRuntime:
    """The real vendor runtime: the bridge, torch (whose `cuda` is the XPU under xpytorch),
    kunlun_ops, the `torch.ops._C` namespace holding vLLM-Kunlun's MoE kernels and, when
    installed, `torch.ops.xspeedgate_ops`. tests/emulators/kunlun.py has the same attributes."""
    EMULATOR = False

    def __init__(self, bridge: Any, torch_module: Any, kunlun_ops: Any, speedgate: Any,
                 speedgate_missing: str) -> None:
        self.bridge, self.torch, self.kunlun_ops = bridge, torch_module, kunlun_ops
        self.cuda = torch_module.cuda
        self.C = torch_module.ops._C
        self.xspeedgate, self.xspeedgate_missing = speedgate, speedgate_missing
        self.__version__ = str(getattr(bridge, "__version__", ""))

    def current_stream(self, device: torch.device) -> int:
        """The raw XPU stream of the device's current stream (xpytorch keeps torch.cuda's
        `cuda_stream` name for it; UNVERIFIED)."""
        return int(self.cuda.current_stream(device).cuda_stream)

    @staticmethod
    def package_version(name: str) -> str | None:
        return distribution_version(name)


class KunlunBackend(VendorBackend):
    vendor_name = "kunlun"
    adapters = ops.ADAPTERS
    behaviours = chips.BEHAVIOURS
    op_limits = ops.OP_LIMITS
    kernels_limit = "xpu_kernels"
    device_noun = "Kunlun XPU"
    device_count_call = "torch.cuda.device_count()"
    device_check = "`{smi} -L` and {visible}"

    def __init__(self, runtime: Any = None, *, torch_module: Any = None, **options: Any) -> None:
        # The torch whose attributes identify the stack (tests pass a stand-in).
        self._torch = torch if torch_module is None else torch_module
        super().__init__(runtime, **options)

    def default_kernels(self) -> Any:
        return kernels.KernelLibrary()

    # -- probe hooks -----------------------------------------------------------------------
    def missing_prerequisite(self) -> str | None:
        reason = super().missing_prerequisite()
        if reason:
            return reason
        flavor = cuda_flavor(self._torch)
        if flavor != "kunlun":
            return (f"{self.vendor.bridge} is installed but this torch build is the {flavor!r} stack "
                    "(glm5_hal.vendors.cuda_flavor), not Kunlun's CUDA-compatible mode")
        return None

    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        fused, reason = import_first(FUSED_OPS_MODULES, "Kunlun's fused-op library, which the kunlun adapters call")
        if fused is None:
            return None, reason
        speedgate, speedgate_missing = import_first((SPEEDGATE_MODULE,), "the XPU kernels behind hadamard_transform")
        namespace = self._torch.ops.xspeedgate_ops if speedgate is not None else None
        return XpuRuntime(bridge, self._torch, fused, namespace, speedgate_missing), ""

    def check_versions(self, runtime: Any) -> dict[str, str]:
        version = require_version("torch", module_version(runtime.torch), chips.MIN_TORCH,
                                  f"Kunlun's CUDA-compatible mode (xpytorch) is torch >= {dotted(chips.MIN_TORCH)}")
        bridge = runtime.__version__
        vllm_kunlun = runtime.package_version(chips.VLLM_KUNLUN)
        return {"torch": version, **({"torch_xmlir": bridge} if bridge else {}),
                **({chips.VLLM_KUNLUN: vllm_kunlun} if vllm_kunlun else {})}

    def devices(self, runtime: Any) -> Any:
        return runtime.cuda

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        device_name = str(runtime.cuda.get_device_name(0))
        if "NVIDIA" in device_name.upper():
            raise Declined(f"cuda device 0 is {device_name!r}, an NVIDIA GPU: the kunlun backend only claims "
                           "Kunlun XPUs")
        if chips.is_kunlun2(device_name):
            raise Declined(f"unsupported XPU {device_name} (Kunlun2): the kunlun backend targets Kunlun3 (P800) "
                           "under xpytorch")
        summary = f"{count} x {device_name} (Kunlun3, CUDA-compatible mode), torch {versions['torch']}" + (
            f", vllm-kunlun {versions[chips.VLLM_KUNLUN]}" if chips.VLLM_KUNLUN in versions else "")
        return ChipInfo(device_name, count, summary, versions=versions)

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return chips.DTYPES_KUNLUN3

    def chip_limits(self, chip: ChipInfo) -> dict:
        runtime = self.runtime
        speedgate = "installed" if runtime.xspeedgate is not None else runtime.xspeedgate_missing
        return {"generation": "Kunlun3", "fp8": False, "indexer_key_quantisation": "int8 (no FP8 on P800)",
                "dist_backend_note": "'nccl' is BKCL underneath (UNVERIFIED)", "xspeedgate_ops": speedgate}

    # -- used by the adapters --------------------------------------------------------------
    def stream(self, device: Any) -> int:
        return self.runtime.current_stream(device)


kunlun = KunlunBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(kunlun)
