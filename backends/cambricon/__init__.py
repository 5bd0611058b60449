"""The Cambricon backend: glm5_hal ops on `torch_mlu` + `torch_mlu_ops` (MLU370, MLU590).

`CambriconBackend(runtime=None)` loads the bridge lazily; tests inject an emulator instead
(`CambriconBackend(runtime=MluEmulator("MLU590"), name="cambricon_emu", device_type="cpu")`).
Every instance declares its own adapters (closures over the instance, reaching the vendor
through `backend.runtime`), so a real and an emulated backend coexist. Registered through
the `glm5_hal.backends` entry point. README.md has the op mapping and what is verified how.

Probe order (the first failing step is the reason; nothing here raises or exits):
  1. the bridge is installed (`torch_mlu`, found without importing it)
  2. the Neuware runtime libraries load (libcnrt.so, libcndev.so), before importing the
     bridge, so a missing SDK is named instead of surfacing as an import crash
  3. `import torch_mlu` (guarded: any failure, even SystemExit, becomes the reason)
  4. `import torch_mlu_ops` (the fused-op library the adapters call)
  5. torch_mlu_ops is at least chips.MIN_TMO
  6. an MLU is visible (torch.mlu.device_count() > 0)
  7. device 0's capability major is supported (>= 3: MLU370 or newer)
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
from typing import Any

import torch

from glm5_hal import Availability, Capabilities, hookimpl
from glm5_hal.vendor_backend import VendorBackend, at_least, dotted, describe_import_failure, import_bridge
from glm5_hal.vendors import Vendor, installed

from . import chips, kernels, ops
from .chips import Generation

TMO_MODULE = "torch_mlu_ops"


class MluRuntime:
    """The real vendor runtime: the bridge, the `torch.mlu` device module it registers, the
    fused-op library and torch.backends (matmul precision flags). The emulator in
    tests/emulators/cambricon.py has the same attributes."""
    EMULATOR = False

    def __init__(self, bridge: Any, mlu: Any, tmo: Any, backends: Any) -> None:
        self.bridge, self.mlu, self.tmo, self.backends = bridge, mlu, tmo, backends
        self.__version__ = str(getattr(bridge, "__version__", ""))

    def current_queue(self, device: torch.device) -> int:
        """The raw cnrtQueue_t of the device's current stream (torch_mlu names the handle
        `mlu_stream`, like torch.cuda's `cuda_stream`; unconfirmed)."""
        return int(self.mlu.current_stream(device).mlu_stream)


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    generation: Generation
    capability: tuple[int, int]
    device_name: str
    device_count: int
    tmo_version: str
    bridge_version: str


class CambriconBackend(VendorBackend):
    vendor_name = "cambricon"
    priority = 100

    def __init__(self, runtime: Any = None, *, name: str | None = None, device_type: str | None = None,
                 priority: int | None = None, kernel_library: Any = None) -> None:
        super().__init__(runtime, name=name, device_type=device_type, priority=priority)
        self.chip: ChipInfo | None = None
        self.kernels = kernel_library if kernel_library is not None else kernels.KernelLibrary()
        ops.declare(self)

    # -- probing ---------------------------------------------------------------------------
    def load_runtime(self) -> tuple[Any, str]:
        if not installed(self.vendor.bridge):
            return None, f"bridge {self.vendor.bridge} not installed"
        missing = missing_runtime_library(self.vendor)
        if missing:
            return None, missing
        bridge, reason = import_bridge(self.vendor)
        if bridge is None:
            return None, reason
        tmo, reason = import_fused_ops(self.vendor)
        if tmo is None:
            return None, reason
        mlu = getattr(torch, "mlu", None)
        if mlu is None:
            return None, "torch_mlu imported but registered no torch.mlu device module"
        return MluRuntime(bridge, mlu, tmo, torch.backends), ""

    def probe_runtime(self, runtime: Any) -> Availability:
        tmo_version = str(getattr(runtime.tmo, "__version__", ""))
        minimum = f"the adapters follow the torch_mlu_ops {dotted(chips.MIN_TMO)} op semantics"
        if not at_least(tmo_version, chips.MIN_TMO):
            return Availability(False, f"torch_mlu_ops {tmo_version or '(no __version__)'} is too old: {minimum}")
        mlu = runtime.mlu
        try:
            count = int(mlu.device_count()) if mlu.is_available() else 0
        except Exception as exc:  # CNDEV errors surface here on broken installs
            return Availability(False, f"querying MLU devices failed: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability(False, "no MLU device visible (torch.mlu.device_count() == 0; check "
                                       f"`{self.vendor.smi}` and {self.vendor.visible_devices})")
        try:
            major, minor = (int(v) for v in mlu.get_device_capability(0))
            device_name = str(mlu.get_device_name(0))
        except Exception as exc:
            return Availability(False, f"reading the MLU identity failed: {type(exc).__name__}: {exc}")
        gen = chips.generation_of(major)
        if gen is None:
            return Availability(False, f"unsupported MLU {device_name} (capability {major}.{minor}); the "
                                       f"cambricon backend needs capability >= {chips.MIN_MAJOR}.0 "
                                       "(MLU370 or newer)")
        self.chip = ChipInfo(gen, (major, minor), device_name, count, tmo_version, runtime.__version__)
        return Availability(True, f"{count} x {device_name} ({gen.label}, capability {major}.{minor}), "
                                  f"torch_mlu_ops {tmo_version}")

    def capabilities(self) -> Capabilities:
        chip = self.chip
        if chip is None:  # only asked after a successful probe
            return Capabilities(dist_backend=self.vendor.dist_backend)
        gen = chip.generation
        return Capabilities(
            dtypes=chips.device_dtypes(gen), dist_backend=self.vendor.dist_backend,
            device_name=chip.device_name,
            limits={"generation": gen.label, "capability": "%d.%d" % chip.capability,
                    "devices": chip.device_count, "bf16": gen.bf16, "fp8": gen.fp8,
                    "bang_kernels": self.kernels.status(), **ops.OP_LIMITS})

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        if self.chip is not None:
            versions.update({"torch_mlu_ops": self.chip.tmo_version,
                             "chip": f"{self.chip.device_name} (capability %d.%d)" % self.chip.capability})
            if self.chip.bridge_version:
                versions["torch_mlu"] = self.chip.bridge_version
        return versions

    # -- used by the adapters --------------------------------------------------------------
    def fp8_declined(self) -> str | None:
        """None when the MLU computes in FP8, else the capability reason."""
        chip = self.chip
        if chip is not None and chip.generation.fp8:
            return None
        where = f"{chip.device_name} (capability %d.%d)" % chip.capability if chip else "this MLU"
        return f"{where} has no FP8 (torch_mlu: FP8 needs capability major >= {chips.FP8_MAJOR})"


def missing_runtime_library(vendor: Vendor) -> str | None:
    """Loads the Neuware libraries torch_mlu links against; the reason naming the first that
    cannot be loaded, or None. Cheaper than importing torch_mlu, and it names the library."""
    for library in chips.NEUWARE_LIBRARIES:
        try:
            ctypes.CDLL(library)
        except OSError as exc:
            if "cannot open shared object" in str(exc):
                return describe_import_failure(vendor, exc)
            return f"runtime library {library} does not load: {exc}"
    return None


def import_fused_ops(vendor: Vendor) -> tuple[Any, str]:
    """Imports torch_mlu_ops without letting any failure escape."""
    if not installed(TMO_MODULE):
        return None, (f"{TMO_MODULE} not installed (Cambricon's fused-op library, which every "
                      f"cambricon adapter calls; install the wheel matching {vendor.bridge})")
    try:
        return importlib.import_module(TMO_MODULE), ""
    except BaseException as exc:  # native initialisers; contain everything
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, f"importing {TMO_MODULE} failed: {type(exc).__name__}: {exc}"


cambricon = CambriconBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(cambricon)
