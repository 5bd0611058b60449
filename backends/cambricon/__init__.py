"""The Cambricon backend: glm5_hal ops on `torch_mlu` + `torch_mlu_ops` (MLU370, MLU590).

`CambriconBackend(runtime=None)` loads the bridge lazily; tests inject an emulator instead
(`CambriconBackend(runtime=MluEmulator("MLU590"), name="cambricon_emu", device_type="cpu")`).
Every instance binds the adapter table (ops.ADAPTERS) to itself, each adapter reaching the
vendor through `backend.runtime`, so a real and an emulated backend coexist. Registered
through the `glm5_hal.backends` entry point. README.md has the op mapping and what is
verified how.

Probe order (glm5_hal.vendor_backend's skeleton over the hooks below; the first failing step
is the reason; nothing here raises or exits):
  1. the bridge is installed (`torch_mlu`, found without importing it)
  2. the Neuware runtime libraries load (libcnrt.so, libcndev.so), before importing the
     bridge, so a missing SDK is named instead of surfacing as an import crash
  3. `import torch_mlu` (guarded: any failure, even SystemExit, becomes the reason)
  4. `import torch_mlu_ops` (the fused-op library the adapters call)
  5. torch_mlu_ops is at least chips.MIN_TMO
  6. an MLU is visible (torch.mlu.device_count() > 0)
  7. device 0's capability major is supported (>= 3: MLU370 or newer); FP8 only where the
     installed torch_mlu's is_fp8_supported() says so
  8. the versioned behaviours (chips.BEHAVIOURS: torch_mlu_ops' signatures, read from 1.12.1
     only) are chosen from the installed torch_mlu_ops; another version narrows the backend
"""
from __future__ import annotations

from typing import Any

import torch

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import (ChipInfo, Declined, VendorBackend, dotted, import_first, module_version,
                                     require_version)

from . import chips, kernels, ops

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
        """The raw cnrtQueue_t of the device's current stream (torch_mlu's Stream.mlu_stream,
        torch_mlu/mlu/streams.py:100 @d578002c)."""
        return int(self.mlu.current_stream(device).mlu_stream)


class CambriconBackend(VendorBackend):
    vendor_name = "cambricon"
    adapters = ops.ADAPTERS
    behaviours = chips.BEHAVIOURS
    op_limits = ops.OP_LIMITS
    kernels_limit = "bang_kernels"
    device_noun = "MLU device"
    device_count_call = "torch.mlu.device_count()"

    def default_kernels(self) -> Any:
        return kernels.KernelLibrary()

    # -- probe hooks -----------------------------------------------------------------------
    def runtime_libraries(self) -> tuple[str, ...]:
        return chips.NEUWARE_LIBRARIES

    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        tmo, reason = import_first((TMO_MODULE,), "Cambricon's fused-op library, which every cambricon adapter "
                                                  f"calls; install the wheel matching {self.vendor.bridge}")
        if tmo is None:
            return None, reason
        mlu = getattr(torch, "mlu", None)
        if mlu is None:
            return None, "torch_mlu imported but registered no torch.mlu device module"
        return MluRuntime(bridge, mlu, tmo, torch.backends), ""

    def check_versions(self, runtime: Any) -> dict[str, str]:
        version = require_version("torch_mlu_ops", module_version(runtime.tmo), chips.MIN_TMO,
                                  f"the adapters follow the torch_mlu_ops {dotted(chips.MIN_TMO)} op semantics")
        bridge = runtime.__version__
        return {"torch_mlu_ops": version, **({"torch_mlu": bridge} if bridge else {})}

    def devices(self, runtime: Any) -> Any:
        return runtime.mlu

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        major, minor = (int(v) for v in runtime.mlu.get_device_capability(0))
        device_name = str(runtime.mlu.get_device_name(0))
        fp8_query = getattr(runtime.mlu, chips.FP8_QUERY, None)
        gen = chips.generation_of(major, fp8=bool(fp8_query()) if callable(fp8_query) else False)
        if gen is None:
            raise Declined(f"unsupported MLU {device_name} (capability {major}.{minor}); the cambricon backend "
                           f"needs capability >= {chips.MIN_MAJOR}.0 (MLU370 or newer)")
        capability = f"{major}.{minor}"
        summary = (f"{count} x {device_name} ({gen.label}, capability {capability}), "
                   f"torch_mlu_ops {versions['torch_mlu_ops']}")
        fp8 = (f"torch.mlu.is_fp8_supported() is {gen.fp8}" if callable(fp8_query) else
               "this torch_mlu has no is_fp8_supported() (the public torch_mlu @d578002c has none), so none is declared")
        return ChipInfo(device_name, count, summary, generation=gen, identity=f"capability {capability}",
                        versions=versions, facts={"capability": capability, "fp8_source": fp8})

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return chips.device_dtypes(chip.generation)

    def chip_limits(self, chip: ChipInfo) -> dict:
        gen = chip.generation
        return {"generation": gen.label, "bf16": gen.bf16, "fp8": gen.fp8}

    # -- used by the adapters --------------------------------------------------------------
    def stream(self, device: Any) -> int:
        """The queue the kernels are launched on: the device's current cnrtQueue_t."""
        return self.runtime.current_queue(device)

    def fp8_declined(self) -> str | None:
        """None when the MLU computes in FP8, else the capability reason."""
        chip = self.chip
        if chip is not None and chip.generation.fp8:
            return None
        if chip is None:
            return "this MLU has no FP8 declared"
        return f"{chip.device_name} ({chip.identity}) has no FP8: {chip.facts['fp8_source']}"


cambricon = CambriconBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(cambricon)
