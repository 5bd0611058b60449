"""The backend set and dispatch decisions: plugin loading, which implementation serves a
decision key, fallback accounting, and the module-level API `glm5_hal` re-exports.

Ops themselves (definition, torch binding, the per-call code) live in glm5_hal.opdef; an op
asks this registry once per decision key (device, dtype, pinned backend, op extras) and
caches the answer. A decision lists the candidate implementations in order: available
backends of the key's device type by descending priority (or only the pinned backend), then
the reference. Unavailable backends, missing ops, undeclared dtypes and dtypes outside the
device's capabilities are rejected here, once per key; `supports` predicates run per call.
Running the reference while a non-reference backend of that device type is available is a
*fallback*: warned once per (op, backend, reason), counted, and an UnsupportedOpError under
GLM5_HAL_STRICT=1.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

import torch

from . import opdef
from .backend import ANY_DEVICE, REFERENCE, Backend, Capabilities, Impl
from .errors import BackendUnavailableError, HalError, PluginError, UnsupportedOpError
from .opdef import Decision, Explanation, Op
from .plugins import PluginHost, PluginOutcome, Settings

#: GLM5_HAL_CHECKS values: "default" runs value checks on CPU tensors only (reading device
#: data would synchronise the device); "full" runs them on every device.
CHECK_MODES = ("default", "full")


class FallbackWarning(UserWarning):
    """The reference implementation ran although a device backend is available."""


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """One row of `glm5_hal.backends()`."""
    name: str
    device_type: str
    priority: int
    available: bool
    reason: str
    versions: dict
    ops: tuple[str, ...]
    error: str | None = None
    plugin: str = ""
    capabilities: Capabilities | None = None


@dataclasses.dataclass
class Loaded:
    """The loaded plugin state: settings, every admitted backend, what each plugin produced,
    and the available non-reference backends of each device type, best first."""
    settings: Settings
    full_checks: bool
    backends: dict[str, Backend]
    outcomes: list[PluginOutcome]
    by_device: dict[str, list[Backend]]


class Registry:
    """The process-wide backend set and decision maker (the ops' dispatcher)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loaded: Loaded | None = None
        self._runtime_plugins: dict[str, Any] = {}
        self._fallback_counts: collections.Counter = collections.Counter()
        self._warned: set[tuple[str, str, str]] = set()

    # -- plugins -----------------------------------------------------------------------
    def loaded(self) -> Loaded:
        loaded = self._loaded
        if loaded is None:
            with self._lock:
                if self._loaded is None:
                    self._loaded = self._load()
                loaded = self._loaded
        return loaded

    def _load(self) -> Loaded:
        settings = Settings.from_env()
        full_checks = _checks_mode() == "full"
        host = PluginHost(validate_backend)
        outcomes: list[PluginOutcome] = []
        backends: dict[str, Backend] = {}
        # The reference plugin first: it defines every op's last resort (and imports the ops,
        # so the other plugins' implementations are checked against the complete op table).
        entry_points = sorted(host.entry_points(), key=lambda ep: (ep.name != REFERENCE, ep.name))
        known_names = {ep.name for ep in entry_points} | set(self._runtime_plugins)

        def take(outcome: PluginOutcome) -> None:
            outcomes.append(outcome)
            for b in outcome.backends:
                known_names.add(b.name)
                if settings.admits(b.name):
                    backends[b.name] = b

        for ep in entry_points:
            if settings.admits(ep.name):
                take(host.load_entry_point(ep, set(backends)))
        for name, plugin in self._runtime_plugins.items():
            if settings.admits(name):
                take(host.load(plugin, name, "loaded at run time (load_plugin)", set(backends)))

        unknown = sorted(((settings.allow or set()) | settings.deny) - known_names - {REFERENCE})
        if unknown:
            raise PluginError(f"GLM5_HAL_PLUGINS/GLM5_HAL_DISABLE name unknown backends {unknown}; "
                              f"known: {sorted(known_names)}")
        broken = [o for o in outcomes if o.error]
        if settings.strict and broken:
            raise PluginError("GLM5_HAL_STRICT=1 and plugins failed to load: " +
                              "; ".join(f"{o.name}: {o.error}" for o in broken))
        by_device: dict[str, list[Backend]] = collections.defaultdict(list)
        for b in backends.values():
            if b.name != REFERENCE and b.availability().available:
                by_device[b.device_type].append(b)
        for blist in by_device.values():
            blist.sort(key=lambda b: (-b.priority, b.name))
        return Loaded(settings, full_checks, backends, outcomes, dict(by_device))

    def reload(self) -> None:
        """Forget loaded plugins, decisions and counters; re-read the environment on next use."""
        with self._lock:
            self._loaded = None
            self._fallback_counts.clear()
            self._warned.clear()
            for op in opdef.OPS.values():
                op.clear()

    def load_plugin(self, plugin: Any, name: str) -> None:
        """Register a plugin object (module, class or instance with hookimpls) at run time,
        through the same path entry-point plugins take."""
        with self._lock:
            if name in self._runtime_plugins:
                raise PluginError(f"a run-time plugin named {name!r} is already loaded")
            self._runtime_plugins[name] = plugin
            self.reload()

    def unload_plugin(self, name: str) -> None:
        with self._lock:
            self._runtime_plugins.pop(name, None)
            self.reload()

    # -- queries -----------------------------------------------------------------------
    def backends(self) -> list[BackendInfo]:
        loaded = self.loaded()
        rows = []
        for b in sorted(loaded.backends.values(), key=lambda b: (b.name != REFERENCE, b.device_type, -b.priority, b.name)):
            avail = b.availability()
            rows.append(BackendInfo(
                name=b.name, device_type=b.device_type, priority=b.priority,
                available=avail.available, reason=avail.reason, versions=_safe_versions(b),
                ops=tuple(sorted(b.impls)), error=None,
                plugin=next((o.source for o in loaded.outcomes if b in o.backends), ""),
                capabilities=b.cached_capabilities() if avail.available else None))
        for o in loaded.outcomes:
            if o.error:
                rows.append(BackendInfo(name=o.name, device_type="?", priority=0, available=False,
                                        reason="plugin quarantined", versions={}, ops=(),
                                        error=o.error, plugin=o.source))
        return rows

    def get_backend(self, name: str) -> Backend:
        loaded = self.loaded()
        if name in loaded.backends:
            return loaded.backends[name]
        for o in loaded.outcomes:
            if o.error and o.name == name:
                raise BackendUnavailableError(f"backend {name!r}: plugin quarantined: {o.error}")
        raise BackendUnavailableError(f"no backend named {name!r}; registered: {sorted(loaded.backends)}")

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[Backend]:
        backend = self.get_backend(name)
        avail = backend.availability()
        if not avail.available:
            raise BackendUnavailableError(f"backend {name!r} is not available: {avail.reason}")
        with opdef.pinned(name):
            yield backend

    def fallback_stats(self) -> dict[tuple[str, str, str], int]:
        return dict(self._fallback_counts)

    # -- decisions (opdef.Dispatcher) ----------------------------------------------------
    def decide(self, op: Op, decision_key: tuple) -> Decision:
        loaded = self.loaded()
        device, dtype, pin = decision_key[0], decision_key[1], decision_key[2]
        device_type = device.type
        if pin is not None:
            considered = [] if pin == REFERENCE else [loaded.backends[pin]]
        else:
            considered = loaded.by_device.get(device_type, [])
        candidates: list[Impl] = []
        rejected: list[tuple[Backend, str]] = []
        for b in considered:
            reason = static_rejection(b, op.name, device_type, dtype)
            if reason is None:
                candidates.append(b.impls[op.name])
            else:
                rejected.append((b, reason))
        ref_backend = loaded.backends.get(REFERENCE)
        ref = ref_backend.impls.get(op.name) if ref_backend is not None else None
        if ref is None:  # an install without the reference entry point still dispatches
            ref = Impl(op.name, _ORPHAN_REFERENCE, op.reference, None, None)
        candidates.append(ref)
        vendor = any(b.device_type == device_type and b.availability().available for b in considered)
        error = None
        if loaded.settings.strict and vendor and len(candidates) == 1:
            error = _fallback_message(op.name, device_type, dtype, rejected)
        values = None
        if op.check_values is not None and (device_type == "cpu" or loaded.full_checks):
            values = op.check_values
        return Decision(tuple(candidates), tuple(rejected), vendor, values, error)

    def fallback(self, op: Op, decision_key: tuple, decision: Decision,
                 rejections: list[tuple[Backend, str]]) -> None:
        if self.loaded().settings.strict:
            raise UnsupportedOpError(decision.error or _fallback_message(
                op.name, decision_key[0].type, decision_key[1], rejections))
        for backend, reason in rejections:
            k = (op.name, backend.name, reason)
            self._fallback_counts[k] += 1
            if k not in self._warned:
                self._warned.add(k)
                warnings.warn(f"glm5_hal: {op.name} runs the reference implementation: backend "
                              f"{backend.name!r} declined: {reason}", FallbackWarning,
                              stacklevel=_caller_stacklevel())


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel, called from here, that names the first frame outside
    dispatch (this module, glm5_hal.opdef, the generated op functions, and torch's own frames
    when the call went through torch.ops): the caller's line, however many dispatch frames
    the call went through."""
    internal = (__file__, opdef.__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename in internal
                                 or frame.f_code.co_filename.startswith(("<glm5_hal op", _TORCH_DIR))):
        frame, level = frame.f_back, level + 1
    return level


def validate_backend(backend: Backend) -> None:
    """A backend's implementations name known ops and take exactly the op's parameters
    (raises PluginError; the plugin host adds the plugin's name and quarantines it)."""
    unknown = sorted(set(backend.impls) - set(opdef.OPS))
    if unknown:
        raise PluginError(f"backend {backend.name!r} implements unknown ops {unknown}")
    for name, impl in backend.impls.items():
        why = opdef.signature_mismatch(opdef.OPS[name], impl.fn)
        if why:
            raise PluginError(f"backend {backend.name!r}: the implementation of {name} {why}")


def static_rejection(b: Backend, op: str, device_type: str, dtype: torch.dtype) -> str | None:
    """Why backend `b` cannot serve `op` for (device type, dtype) whatever the call, as
    dispatch words it; None if it might (its `supports` predicate decides per call)."""
    if b.device_type != device_type and b.device_type != ANY_DEVICE:
        return f"takes {b.device_type} tensors, the call has {device_type} tensors"
    avail = b.availability()
    if not avail.available:
        return f"unavailable: {avail.reason}"
    impl = b.impls.get(op)
    if impl is None:
        return f"does not implement {op}"
    if impl.dtypes is not None and dtype not in impl.dtypes:
        return f"implements {op} for {_dtypes(impl.dtypes)}, not {_dtype(dtype)}"
    caps = b.cached_capabilities()
    if dtype.is_floating_point and caps.dtypes and dtype not in caps.dtypes:
        return (f"device {caps.device_name or b.device_type} does not support {_dtype(dtype)} "
                f"(capabilities: {_dtypes(caps.dtypes)})")
    return None


def _checks_mode() -> str:
    mode = os.environ.get("GLM5_HAL_CHECKS", "").strip().lower() or "default"
    if mode not in CHECK_MODES:
        raise HalError(f"GLM5_HAL_CHECKS: expected one of {list(CHECK_MODES)}, got {mode!r}")
    return mode


def _fallback_message(op: str, device_type: str, dtype: torch.dtype,
                      rejected: list[tuple[Backend, str]]) -> str:
    why = "; ".join(f"{b.name}: {r}" for b, r in rejected) or "no backend implements it"
    return (f"{op} on {device_type}/{_dtype(dtype)} would fall back to the reference "
            f"(GLM5_HAL_STRICT=1): {why}")


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _dtypes(ds) -> str:
    return "{" + ", ".join(sorted(_dtype(d) for d in ds)) + "}"


def _safe_versions(b: Backend) -> dict:
    try:
        return dict(b.versions())
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


class _OrphanReference(Backend):
    name = REFERENCE
    device_type = ANY_DEVICE
    priority = -(2 ** 31)


_ORPHAN_REFERENCE = _OrphanReference()

REGISTRY = Registry()
opdef.set_dispatcher(REGISTRY)


# -- the module-level API re-exported by glm5_hal --------------------------------------------
def backends() -> list[BackendInfo]:
    """One record per registered backend (available or not) and per quarantined plugin."""
    return REGISTRY.backends()


def get_backend(name: str) -> Backend:
    """The registered backend called `name` (BackendUnavailableError if there is none)."""
    return REGISTRY.get_backend(name)


def use(name: str):
    """Context manager pinning dispatch to backend `name` (then the reference) in this context."""
    return REGISTRY.use(name)


def explain(op: "str | Callable", *args: Any, **kwargs: Any) -> Explanation:
    """What dispatch would choose for `op(*args, **kwargs)`, with every rejection's reason."""
    name = op if isinstance(op, str) else getattr(op, "__name__", repr(op))
    REGISTRY.loaded()  # loading the plugins defines every op
    return opdef.lookup(name).explain(*args, **kwargs)


def fallback_stats() -> dict[tuple[str, str, str], int]:
    """How often each (op, backend, reason) fallback to the reference has happened."""
    return REGISTRY.fallback_stats()


def load_plugin(plugin: Any, name: str) -> None:
    """Register a plugin object at run time (same path as entry-point plugins)."""
    REGISTRY.load_plugin(plugin, name)


def unload_plugin(name: str) -> None:
    REGISTRY.unload_plugin(name)


def reload() -> None:
    """Re-read GLM5_HAL_* settings and reload plugins on next use; clears decisions and counters."""
    REGISTRY.reload()
