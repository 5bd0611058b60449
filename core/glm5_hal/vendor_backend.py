"""The base class of the vendor backends (backends/<vendor>/): a Backend whose kernels are
reached through the vendor's PyTorch bridge -- or through an emulator of it.

The runtime is injected: `AscendBackend(runtime=torch_npu)` on real hardware, or
`AscendBackend(runtime=NpuEmulator(), ...)` in tests, so the very same adapter code runs
against both. With no runtime given, the bridge is imported lazily by `probe()`, guarded so
that a bridge without its vendor runtime (torch_npu without CANN) yields a specific
"unavailable" reason instead of an exception.
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable

from .backend import Availability, Backend
from .vendors import VENDORS, Vendor, installed

_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]*\.so[\w.]*)")


class VendorBackend(Backend):
    """Subclasses set `vendor_name` (a key of glm5_hal.vendors.VENDORS) and implement
    `probe_runtime(runtime)`: device count, chip identity, version checks."""
    vendor_name: str = ""

    def __init__(self, runtime: Any = None, *, name: str | None = None,
                 device_type: str | None = None, priority: int | None = None) -> None:
        super().__init__()
        self.vendor: Vendor = VENDORS[self.vendor_name]
        self.name = name or self.vendor.backend
        self.device_type = device_type or self.vendor.device_type
        if priority is not None:
            self.priority = priority
        self.emulated = runtime is not None and bool(getattr(runtime, "EMULATOR", False))
        self._runtime = runtime

    @property
    def runtime(self) -> Any:
        """The bridge module (or emulator); only valid after a successful probe."""
        return self._runtime

    # -- probing ---------------------------------------------------------------------------
    def probe(self) -> Availability:
        if self._runtime is None:
            runtime, reason = self.load_runtime()
            if runtime is None:
                return Availability(False, reason)
            self._runtime = runtime
        result = self.probe_runtime(self._runtime)
        if result.available and self.emulated:
            return Availability(True, f"EMULATED ({type(self._runtime).__name__}): {result.reason}")
        return result

    def load_runtime(self) -> tuple[Any, str]:
        """Import the vendor bridge; (module, "") or (None, specific reason). Never raises."""
        return import_bridge(self.vendor)

    def probe_runtime(self, runtime: Any) -> Availability:
        raise TypeError(f"{type(self).__name__} must implement probe_runtime(runtime)")

    def versions(self) -> dict[str, str]:
        runtime = self._runtime
        if runtime is None:
            return {}
        if self.emulated:
            return {"runtime": f"emulator {type(runtime).__name__}"}
        version = getattr(runtime, "__version__", None)
        return {self.vendor.bridge or "runtime": str(version)} if version else {}


def import_bridge(vendor: Vendor) -> tuple[Any, str]:
    """Import `vendor.bridge` without letting any failure escape. The reason distinguishes:
    bridge not installed / runtime library missing (which one) / import failed otherwise."""
    module = vendor.bridge
    if module is None:
        raise TypeError(f"vendor {vendor.backend} has no bridge module; override load_runtime()")
    if not installed(module):
        return None, f"bridge {module} not installed"
    try:
        return importlib.import_module(module), ""
    except BaseException as exc:  # bridges run native initialisers; contain everything
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, describe_import_failure(vendor, exc)


def describe_import_failure(vendor: Vendor, exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    lib = _MISSING_LIBRARY.search(str(exc))
    if isinstance(exc, (ImportError, OSError)) and lib and "cannot open shared object" in str(exc):
        roots = "/".join(vendor.toolchain_env)
        return (f"runtime library missing: {lib.group(1)} ({vendor.bridge} is installed, but the "
                f"vendor runtime is not on the library path; is the SDK installed and {roots} set?)")
    return f"importing {vendor.bridge} failed: {text}"


# -- helpers the vendor backends share ----------------------------------------------------------
def leading_numbers(version: object) -> tuple[int, ...]:
    """(8, 3) for "8.3.RC1", (2, 13, 0) for "2.13.0+git...", (1, 12, 1) for "1.12.1+torch2.11";
    () when the string does not start with a number."""
    numbers = []
    for piece in re.split(r"[.+]", str(version).strip()):
        if not piece.isdigit():
            break
        numbers.append(int(piece))
    return tuple(numbers)


def at_least(version: object, minimum: tuple[int, ...]) -> bool | None:
    """Whether `version` >= `minimum` on the first len(minimum) numbers; None if unparsable."""
    numbers = leading_numbers(version)
    if len(numbers) < len(minimum):
        return None
    return numbers[: len(minimum)] >= minimum


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def device_dtypes(*, bf16: bool = True, fp8: bool = False) -> frozenset:
    """The activation/storage dtypes of a device generation: float32 and float16 always."""
    import torch
    dtypes = {torch.float32, torch.float16}
    if bf16:
        dtypes.add(torch.bfloat16)
    if fp8:
        dtypes.add(torch.float8_e4m3fn)
    return frozenset(dtypes)


#: what an adapter's `supports(*args)` returns: True, or the reason it declines
Verdict = "bool | str"


def first_reason(*checks: Callable[[], "str | None"]) -> Verdict:
    """True if every check returns no reason, else the first reason (checks run in order,
    so a cheap check guards a costlier one)."""
    for check in checks:
        reason = check()
        if reason:
            return reason
    return True


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
