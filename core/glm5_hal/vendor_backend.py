"""The base class of the vendor backends (backends/<vendor>/): a Backend whose kernels are
reached through the vendor's PyTorch bridge -- or through an emulator of it.

The runtime is injected: `AscendBackend(runtime=torch_npu)` on real hardware, or
`AscendBackend(runtime=NpuEmulator(), ...)` in tests, so the very same adapter code runs
against both. With no runtime given, `probe()` loads it lazily and guarded, so that a bridge
without its vendor runtime (torch_npu without CANN) yields a specific "unavailable" reason
instead of an exception.

`VendorBackend` holds the one probe every vendor runs, in this order, the first failing
step being the reason:
  1. load the runtime: the bridge is installed, the vendor's native libraries load, the
     bridge imports, the runtime object is assembled        (`load_runtime`)
  2. read and check the software versions                  (hook `check_versions`)
  3. count the devices                                     (hook `devices`)
  4. identify the chip                                     (hook `identify_chip`)
  5. choose each versioned behaviour (`behaviours`: Behaviour records) from the installed
     versions; one outside its verified range narrows the backend (the adapters depending on
     it decline with `unverified(name)`), and the availability reason says so
and reports capabilities and versions from what it found (hooks `chip_dtypes`,
`chip_limits`). A vendor package supplies only these hooks.

Adapters are module-level functions `fn(backend, <the op's parameters>)` listed in a table
of `Adapter` records (the vendor's `ops.ADAPTERS`); each backend instance binds the table to
itself, so a real and an emulated backend coexist, each reaching its own runtime.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import re
from typing import Any, Callable, Iterable

import torch

from .backend import Availability, Backend, Capabilities
from .registry import REGISTRY
from .vendors import VENDORS, Vendor, installed

_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]*\.so[\w.]*)")

#: what an adapter's `supports(backend, *args)` returns: True, or the reason it declines
Verdict = "bool | str"
INT32_MAX = 2**31 - 1


class Declined(Exception):
    """Raised by a probe hook: the backend cannot run here; the message is the reason."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A vendor's implementation of one op: `fn(backend, <the op's parameters, named and
    ordered as glm5_hal.reference.<op>'s>)`; `supports(backend, <the same parameters>)`
    returns True or the reason it declines the call (see `Backend.impl` for the rest)."""
    op: str
    fn: Callable
    dtypes: Iterable | None = None
    supports: Callable | None = None
    validates_values: bool = False
    supports_metadata: Callable | None = None   # see Backend.impl: evaluated once per call key

    def bind(self, backend: Backend) -> None:
        """Declares `fn` with `backend` bound as `backend`'s implementation of `op`."""
        def bound(predicate: Callable | None) -> Callable | None:
            return None if predicate is None else functools.partial(predicate, backend)
        backend.impl(self.op, dtypes=self.dtypes, supports=bound(self.supports),
                     validates_values=self.validates_values,
                     supports_metadata=bound(self.supports_metadata))(functools.partial(self.fn, backend))


@dataclasses.dataclass(frozen=True)
class Era:
    """From version `since` of a vendor package on, a behaviour has `value`, as read from
    `source` (repository + path + version, or a file inside a published wheel)."""
    since: tuple[int, ...]
    value: Any
    source: str


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """A vendor behaviour that changed between versions of `package` (a key of the probe's
    versions): its eras, oldest first, and the newest version it was verified against. The
    probe picks the era of the installed version; a version outside [oldest era, verified_up_to]
    is unverified, and the adapters that depend on the behaviour decline, saying so."""
    name: str
    package: str
    eras: tuple[Era, ...]
    verified_up_to: tuple[int, ...]

    def resolve(self, version: str | None) -> tuple[Any, str | None]:
        """(value, None) for a verified version, else (None, the reason)."""
        if version is None:
            return None, f"{self.package} is not installed"
        numbers = leading_numbers(version)
        if not numbers:
            return None, f"the {self.package} version could not be read ({version!r})"
        oldest = self.eras[0].since
        if _padded(numbers, oldest) < _padded(oldest, numbers):
            return None, (f"{self.package} {version} is older than {dotted(oldest)}, the oldest version "
                          f"{self.name} was read from")
        newest = self.verified_up_to
        if _padded(numbers[: len(newest)], newest) > _padded(newest, numbers):
            return None, (f"{self.package} {version} is newer than {dotted(newest)}, the newest version "
                          f"{self.name} was verified against")
        era = [e for e in self.eras if _padded(e.since, numbers) <= _padded(numbers, e.since)][-1]
        return era.value, None


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return a + (0,) * max(0, len(b) - len(a))


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    """What a successful probe found."""
    device_name: str
    device_count: int
    summary: str                   # the availability reason, e.g. "8 x Ascend910B2 (...), torch_npu 2.13.0"
    generation: Any = None         # the vendor's generation record (chips.py / arch.py); None: not in its table
    identity: str = ""             # how the device identified itself ("soc 223", "mp_22"), shown by versions()
    versions: dict = dataclasses.field(default_factory=dict)  # the software versions the probe read
    facts: dict = dataclasses.field(default_factory=dict)     # identity facts reported in capabilities().limits


class VendorBackend(Backend):
    """Subclasses set `vendor_name` (a key of glm5_hal.vendors.VENDORS), `adapters`,
    `op_limits`, the probe's words for the devices, and implement the hooks below."""
    vendor_name: str = ""
    priority = 100  # a vendor's own kernels come before the portable cpu backend's (10)
    adapters: tuple[Adapter, ...] = ()
    #: the vendor behaviours chosen by installed versions (Behaviour records)
    behaviours: tuple[Behaviour, ...] = ()
    #: the vendor constraints the adapters check (ops.OP_LIMITS), reported in capabilities().limits
    op_limits: dict = {}
    #: the capabilities().limits key reporting whether the backend's own kernels are built
    kernels_limit: str = "kernels"
    #: the probe's words: "querying <noun>s failed", "no <noun> visible (<count call> == 0; check ...)"
    device_noun: str = "device"
    device_count_call: str = "device_count()"
    device_check: str = "`{smi}` and {visible}"

    def __init__(self, runtime: Any = None, *, name: str | None = None, device_type: str | None = None,
                 priority: int | None = None, kernel_library: Any = None) -> None:
        super().__init__()
        self.vendor: Vendor = VENDORS[self.vendor_name]
        self.name = name or self.vendor.backend
        self.device_type = device_type or self.vendor.device_type
        if priority is not None:
            self.priority = priority
        self.emulated = runtime is not None and bool(getattr(runtime, "EMULATOR", False))
        self._runtime = runtime
        self.chip: ChipInfo | None = None
        self.resolved: dict[str, tuple[Any, str | None]] = {}
        self.kernels = kernel_library if kernel_library is not None else self.default_kernels()
        for adapter in self.adapters:
            adapter.bind(self)

    @property
    def runtime(self) -> Any:
        """The bridge module (or emulator); only valid after a successful probe."""
        return self._runtime

    @property
    def generation(self) -> Any:
        """The chip generation the probe found (None before a successful probe)."""
        return self.chip.generation if self.chip is not None else None

    def default_kernels(self) -> Any:
        """The backend's own kernel library (a glm5_hal.kernel_library.KernelLibrary), if any."""
        return None

    # -- 1. loading the runtime ------------------------------------------------------------
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
        """(runtime, "") or (None, the specific reason). Never raises."""
        reason = self.missing_prerequisite()
        if reason:
            return None, reason
        bridge = None
        if self.vendor.bridge is not None:
            bridge, reason = import_bridge(self.vendor)
            if bridge is None:
                return None, reason
        return self.make_runtime(bridge)

    def missing_prerequisite(self) -> str | None:
        """Why the bridge cannot be imported, found without importing it: not installed, or
        one of `runtime_libraries()` does not load."""
        bridge = self.vendor.bridge
        if bridge is not None and not installed(bridge):
            return f"bridge {bridge} not installed"
        return self.missing_runtime_library()

    def runtime_libraries(self) -> tuple[str, ...]:
        """The vendor libraries the bridge links against, loaded before importing it so that a
        missing SDK is named instead of surfacing as an import crash."""
        return ()

    def missing_runtime_library(self) -> str | None:
        """The reason naming the first of `runtime_libraries()` that cannot be loaded, or None."""
        for library in self.runtime_libraries():
            try:
                ctypes.CDLL(library)
            except OSError as exc:
                if "cannot open shared object" in str(exc):
                    return describe_import_failure(self.vendor, exc)
                return f"runtime library {library} does not load: {exc}"
        return None

    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        """The runtime object the adapters use, built from the imported bridge (None for a
        vendor whose torch is the bridge): (runtime, "") or (None, reason)."""
        return bridge, ""

    # -- 2-4. versions, devices, chip --------------------------------------------------------
    def probe_runtime(self, runtime: Any) -> Availability:
        try:
            versions = self.check_versions(runtime)
            count = self._count_devices(runtime)
            chip = self._identify_chip(runtime, count, versions)
        except Declined as declined:
            return Availability(False, str(declined))
        self.chip = chip
        self.resolved = {b.name: b.resolve(chip.versions.get(b.package, versions.get(b.package)))
                         for b in self.behaviours}
        narrowed = [f"{name}: {why}" for name, (_, why) in self.resolved.items() if why]
        return Availability(True, chip.summary + (f"; narrowed to what is verified ({'; '.join(narrowed)})"
                                                   if narrowed else ""))

    # -- versioned behaviours, for the adapters ------------------------------------------------
    def behaviour(self, name: str) -> Any:
        """The value of behaviour `name` for the installed version (None when unverified)."""
        return self.resolved.get(name, (None, None))[0]

    def unverified(self, name: str) -> str | None:
        """The reason to decline a call that depends on behaviour `name`, or None."""
        value, why = self.resolved.get(name, (None, f"behaviour {name} was not resolved (no probe yet)"))
        return f"{name} unverified here: {why}" if why else None

    def check_versions(self, runtime: Any) -> dict[str, str]:
        """Reads and checks the software versions (raises Declined); returns them for versions()."""
        raise TypeError(f"{type(self).__name__} must implement check_versions(runtime)")

    def devices(self, runtime: Any) -> Any:
        """The device module (`is_available()`, `device_count()`) of the runtime."""
        raise TypeError(f"{type(self).__name__} must implement devices(runtime)")

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        """Reads device 0's identity; raises Declined for a chip the backend does not support."""
        raise TypeError(f"{type(self).__name__} must implement identify_chip(runtime, count, versions)")

    def _count_devices(self, runtime: Any) -> int:
        try:
            module = self.devices(runtime)
            count = int(module.device_count()) if module.is_available() else 0
        except Exception as exc:  # driver errors surface here on broken installs
            raise Declined(f"querying {self.device_noun}s failed: {type(exc).__name__}: {exc}") from None
        if count == 0:
            check = self.device_check.format(smi=self.vendor.smi, visible=self.vendor.visible_devices)
            raise Declined(f"no {self.device_noun} visible ({self.device_count_call} == 0; check {check})")
        return count

    def _identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        try:
            return self.identify_chip(runtime, count, versions)
        except Declined:
            raise
        except Exception as exc:  # a device query failing on a broken install
            raise Declined(f"reading the {self.device_noun} identity failed: {type(exc).__name__}: {exc}") from None

    # -- what the probe found ----------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        chip = self.chip
        if chip is None:  # only asked after a successful probe
            return Capabilities(dist_backend=self.vendor.dist_backend)
        limits = {"devices": chip.device_count, **chip.facts, **self.chip_limits(chip), **self.op_limits}
        if self.resolved:
            limits["versioned"] = {name: value if why is None else f"unverified: {why}"
                                   for name, (value, why) in self.resolved.items()}
        if self.kernels is not None:
            limits[self.kernels_limit] = self.kernels.status()
        return Capabilities(dtypes=self.chip_dtypes(chip), dist_backend=self.chip_dist_backend(chip),
                            device_name=chip.device_name, limits=limits)

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        raise TypeError(f"{type(self).__name__} must implement chip_dtypes(chip)")

    def chip_limits(self, chip: ChipInfo) -> dict:
        """Facts about the chip generation for capabilities().limits."""
        return {}

    def chip_dist_backend(self, chip: ChipInfo) -> str | None:
        return self.vendor.dist_backend

    def versions(self) -> dict[str, str]:
        runtime = self._runtime
        if runtime is None:
            return {}
        if self.emulated:
            versions = {"runtime": f"emulator {type(runtime).__name__}"}
        else:
            version = getattr(runtime, "__version__", None)
            versions = {self.vendor.bridge or "runtime": str(version)} if version else {}
        chip = self.chip
        if chip is not None:
            versions.update(chip.versions)
            versions["chip"] = f"{chip.device_name} ({chip.identity})" if chip.identity else chip.device_name
        return versions


# -- loading, guarded ----------------------------------------------------------------------------
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


def import_first(modules: tuple[str, ...], what: str) -> tuple[Any, str]:
    """Imports the first installed module of `modules` (a vendor library besides the bridge),
    without letting any failure escape: (module, "") or (None, reason)."""
    for module in modules:
        if not installed(module):
            continue
        try:
            return importlib.import_module(module), ""
        except BaseException as exc:  # native initialisers; contain everything
            if isinstance(exc, KeyboardInterrupt):
                raise
            return None, f"importing {module} failed: {type(exc).__name__}: {exc}"
    return None, f"{' / '.join(modules)} not installed ({what})"


def describe_import_failure(vendor: Vendor, exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    lib = _MISSING_LIBRARY.search(str(exc))
    if isinstance(exc, (ImportError, OSError)) and lib and "cannot open shared object" in str(exc):
        roots = "/".join(vendor.toolchain_env)
        return (f"runtime library missing: {lib.group(1)} ({vendor.bridge} is installed, but the "
                f"vendor runtime is not on the library path; is the SDK installed and {roots} set?)")
    return f"importing {vendor.bridge} failed: {text}"


# -- versions ------------------------------------------------------------------------------------
def leading_numbers(version: object) -> tuple[int, ...]:
    """(8, 3) for "8.3.RC1", (2, 13, 0) for "2.13.0+git...", (1, 12, 1) for "1.12.1+torch2.11";
    a PEP 440 post release counts as one more number, after its release: (2, 7, 1, 2) for
    "2.7.1.post2" (torch_npu ships schema changes in post releases); () when the string does
    not start with a number."""
    numbers = []
    for piece in re.split(r"[.+]", str(version).strip()):
        if not piece.isdigit():
            post = re.fullmatch(r"post(\d+)", piece)
            if post and numbers:
                numbers.append(int(post.group(1)))
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


def module_version(module: Any) -> str | None:
    """A module's `__version__` as a string; None when it has none (or an empty one)."""
    return str(getattr(module, "__version__", "") or "") or None


def distribution_version(*names: str) -> str | None:
    """The installed version of the first of the distributions `names` that is installed (its
    package metadata), read without importing it; None when none is installed or readable."""
    from importlib import metadata
    for name in names:
        try:
            version = metadata.version(name)
        except Exception:  # PackageNotFoundError, or broken metadata of a vendor wheel
            continue
        if version:
            return version
    return None


def require_version(what: str, version: str | None, minimum: tuple[int, ...], needs: str) -> str:
    """`version` if it is at least `minimum`, else Declined saying so. `version` None means
    the module has no __version__ (counted as too old); an unparsable one "could not be read"."""
    recent = at_least(version, minimum) if version is not None else False
    if recent is None:
        raise Declined(f"the {what} version could not be read ({version!r}); {needs}")
    if not recent:
        raise Declined(f"{what} {version or '(no __version__)'} is too old: {needs}")
    return version


# -- helpers the adapters share ------------------------------------------------------------------
def host_reads_allowed(t: torch.Tensor) -> bool:
    """Whether an adapter may read `t`'s data on the host to decide something: on CPU tensors,
    or anywhere under GLM5_HAL_CHECKS=full (the debug mode in which dispatch runs the ops'
    value checks on every device). Elsewhere the read would synchronise the device: such a
    check becomes a device-side assert (torch._assert_async) or is skipped."""
    return t.device.type == "cpu" or REGISTRY.loaded().full_checks


def device_dtypes(*, bf16: bool = True, fp8: bool = False) -> frozenset:
    """The activation/storage dtypes of a device generation: float32 and float16 always."""
    dtypes = {torch.float32, torch.float16}
    if bf16:
        dtypes.add(torch.bfloat16)
    if fp8:
        dtypes.add(torch.float8_e4m3fn)
    return frozenset(dtypes)


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
