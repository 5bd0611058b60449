"""The Kunlunxin backend: glm5_hal ops on Kunlun3 (P800) under xpytorch, through
`kunlun_ops`, the vLLM-Kunlun kernels in `torch.ops._C` and `xspeedgate_ops`.

xpytorch runs the XPU in CUDA-compatible mode: tensors live on `cuda` devices, and
torch.distributed's "nccl" is BKCL underneath. So this backend registers for device type
`cuda` and must claim it only when the cuda stack really is Kunlun: glm5_hal.vendors'
cuda_flavor() says "kunlun" (torch_xmlir installed, no DCU/Iluvatar marker on torch), and
device 0 is not an NVIDIA GPU. `KunlunBackend(runtime=XpuEmulator(), name="kunlun_emu",
device_type="cpu")` runs the same adapters against the emulator in tests; every instance
declares its own adapters, so real and emulated backends coexist.

Probe order (the first failing step is the reason; nothing here raises or exits):
  1. the bridge is installed (`torch_xmlir`, found without importing it)
  2. the cuda stack is Kunlun's (vendors.cuda_flavor(torch) == "kunlun")
  3. `import torch_xmlir` (guarded; a missing XRE library such as libxpurt.so is named)
  4. `import kunlun_ops` (or its former name xtorch_ops), the fused-op library
     (`xspeedgate_ops` is optional: without it only hadamard_transform declines)
  5. torch is at least chips.MIN_TORCH (xpytorch's CUDA-compatible mode)
  6. an XPU is visible (torch.cuda.device_count() > 0)
  7. device 0 is a Kunlun3-class XPU: not an NVIDIA GPU, not a Kunlun2 (R200)
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

from glm5_hal import Availability, Capabilities, hookimpl
from glm5_hal.vendor_backend import VendorBackend, at_least, dotted, import_bridge
from glm5_hal.vendors import cuda_flavor, installed

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
        `cuda_stream` name for it; unconfirmed)."""
        return int(self.cuda.current_stream(device).cuda_stream)


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    device_name: str
    device_count: int
    torch_version: str
    bridge_version: str


class KunlunBackend(VendorBackend):
    vendor_name = "kunlun"
    priority = 100

    def __init__(self, runtime: Any = None, *, name: str | None = None, device_type: str | None = None,
                 priority: int | None = None, kernel_library: Any = None, torch_module: Any = None) -> None:
        super().__init__(runtime, name=name, device_type=device_type, priority=priority)
        self.chip: ChipInfo | None = None
        self.kernels = kernel_library if kernel_library is not None else kernels.KernelLibrary()
        # The torch whose attributes identify the stack (tests pass a stand-in).
        self._torch = torch if torch_module is None else torch_module
        ops.declare(self)

    # -- probing ---------------------------------------------------------------------------
    def load_runtime(self) -> tuple[Any, str]:
        if not installed(self.vendor.bridge):
            return None, f"bridge {self.vendor.bridge} not installed"
        flavor = cuda_flavor(self._torch)
        if flavor != "kunlun":
            return None, (f"{self.vendor.bridge} is installed but this torch build is the {flavor!r} stack "
                          "(glm5_hal.vendors.cuda_flavor), not Kunlun's CUDA-compatible mode")
        bridge, reason = import_bridge(self.vendor)
        if bridge is None:
            return None, reason
        fused, reason = import_first(FUSED_OPS_MODULES, "Kunlun's fused-op library, which the kunlun adapters call")
        if fused is None:
            return None, reason
        speedgate, speedgate_missing = import_first((SPEEDGATE_MODULE,), "the XPU kernels behind hadamard_transform")
        namespace = self._torch.ops.xspeedgate_ops if speedgate is not None else None
        return XpuRuntime(bridge, self._torch, fused, namespace, speedgate_missing), ""

    def probe_runtime(self, runtime: Any) -> Availability:
        version = str(getattr(runtime.torch, "__version__", ""))
        if not at_least(version, chips.MIN_TORCH):
            return Availability(False, f"torch {version or '(no __version__)'} is too old: Kunlun's "
                                       f"CUDA-compatible mode (xpytorch) is torch >= {dotted(chips.MIN_TORCH)}")
        cuda = runtime.cuda
        try:
            count = int(cuda.device_count()) if cuda.is_available() else 0
        except Exception as exc:  # XRE errors surface here on broken installs
            return Availability(False, f"querying XPU devices failed: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability(False, "no Kunlun XPU visible (torch.cuda.device_count() == 0; check "
                                       f"`{self.vendor.smi} -L` and {self.vendor.visible_devices} / XPU_VISIBLE_DEVICES)")
        try:
            device_name = str(cuda.get_device_name(0))
        except Exception as exc:
            return Availability(False, f"reading the XPU identity failed: {type(exc).__name__}: {exc}")
        if "NVIDIA" in device_name.upper():
            return Availability(False, f"cuda device 0 is {device_name!r}, an NVIDIA GPU: the kunlun backend "
                                       "only claims Kunlun XPUs")
        if chips.is_kunlun2(device_name):
            return Availability(False, f"unsupported XPU {device_name} (Kunlun2): the kunlun backend targets "
                                       "Kunlun3 (P800) under xpytorch")
        self.chip = ChipInfo(device_name, count, version, runtime.__version__)
        return Availability(True, f"{count} x {device_name} (Kunlun3, CUDA-compatible mode), torch {version}")

    def capabilities(self) -> Capabilities:
        chip = self.chip
        if chip is None:
            return Capabilities(dist_backend=self.vendor.dist_backend)
        runtime = self.runtime
        speedgate = "installed" if runtime.xspeedgate is not None else runtime.xspeedgate_missing
        return Capabilities(
            dtypes=chips.DTYPES_KUNLUN3, dist_backend=self.vendor.dist_backend, device_name=chip.device_name,
            limits={"generation": "Kunlun3", "devices": chip.device_count, "fp8": False,
                    "indexer_key_quantisation": "int8 (no FP8 on P800)",
                    "dist_backend_note": "'nccl' is BKCL underneath (unconfirmed)",
                    "xspeedgate_ops": speedgate, "xpu_kernels": self.kernels.status(), **ops.OP_LIMITS})

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        if self.chip is not None:
            versions.update({"torch": self.chip.torch_version, "chip": self.chip.device_name})
            if self.chip.bridge_version:
                versions["torch_xmlir"] = self.chip.bridge_version
        return versions


def import_first(modules: tuple[str, ...], what: str) -> tuple[Any, str]:
    """Imports the first installed module of `modules`, without letting any failure escape."""
    for module in modules:
        if not installed(module):
            continue
        try:
            return importlib.import_module(module), ""
        except BaseException as exc:  # native initialisers; contain everything
            if isinstance(exc, KeyboardInterrupt):
                raise
            return None, f"importing {module} failed: {type(exc).__name__}: {exc}"
    names = " / ".join(modules)
    return None, f"{names} not installed ({what})"


kunlun = KunlunBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(kunlun)
