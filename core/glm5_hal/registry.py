"""Op definitions, backend registration and dispatch.

Each op is an `OpDef` (schema, mandatory reference implementation, input checks, fake
implementation) turned into a callable `Op` by `define()`. Calling an `Op`:

1. under `torch.compile` (or when autograd needs it) it goes through
   `torch.ops.glm5_hal.<op>`, whose kernel is step 2 and whose fake runs the same checks;
2. otherwise it checks the inputs (raising `InvalidInputError`), computes the decision key
   (device type, dtype of the dispatch argument, pinned backend, op-specific extras) and
   looks the decision up in a per-op dict. A decision with a single unconditional
   implementation is a direct function call; otherwise candidates are tried in order
   (per-call `supports` predicates), the reference last.

Backends of a device type are tried by descending priority; unavailable backends, missing
ops, undeclared dtypes and dtypes outside the device's capabilities are rejected when the
decision is made (once per key), `supports` predicates on every call. Running the reference
while a non-reference backend for that device type is available is a *fallback*: warned
once per (op, backend, reason), counted, and an `UnsupportedOpError` under GLM5_HAL_STRICT=1.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import inspect
import threading
import warnings
from typing import Any, Callable, Iterator

import torch

from .backend import ANY_DEVICE, Backend, Capabilities, Impl, describe_args
from .errors import BackendUnavailableError, HalError, InvalidInputError, PluginError, UnsupportedOpError
from .plugins import REFERENCE, PluginHost, PluginOutcome, Settings

NAMESPACE = "glm5_hal"


class FallbackWarning(UserWarning):
    """The reference implementation ran although a device backend is available."""


@dataclasses.dataclass(frozen=True)
class OpDef:
    """Everything the registry needs to know about one op.

    name: the op name (`glm5_hal.ops.<name>`, `torch.ops.glm5_hal.<name>`).
    schema: torch.library schema without the name, e.g. "(Tensor x, Tensor weight, float eps) -> Tensor".
    reference: the reference implementation; its signature is the op's canonical signature.
    check: metadata validation `check(*args)`: shapes, dtypes, devices, scalar ranges. Must
        work on fake tensors (it also runs at trace time). Raises InvalidInputError.
    check_values: data-dependent validation (index ranges), eager calls only; None if none.
        Skipped on calls that go straight to an implementation declared with
        `validates_values=True` (its kernel raises the same errors itself, before any write).
    fake: the fake (meta) implementation, `fake(*args)` with canonical args.
    dispatch_arg: name of the argument whose device type and dtype key the decision.
    key_extra: optional `key_extra(*args) -> tuple` of further decision-relevant facts
        (e.g. whether a key is an FP8 pair); must be cheap.
    to_torch / from_torch: convert canonical args to the torch.ops schema's flat args and back
        (only for ops with arguments a torch schema cannot express, e.g. an (fp8, scale) pair).
    differentiable: the op has a backward. Unless `autograd` gives one, the backward is
        the vector-Jacobian product of the reference implementation (recomputed in the
        backward pass), so every differentiable op trains correctly on every backend.
    autograd: optional (backward, setup_context) for torch.library.register_autograd.
    """
    name: str
    schema: str
    reference: Callable
    check: Callable[..., None]
    fake: Callable
    dispatch_arg: str
    check_values: Callable[..., None] | None = None
    key_extra: Callable[..., tuple] | None = None
    to_torch: Callable[..., tuple] | None = None
    from_torch: Callable[..., tuple] | None = None
    differentiable: bool = False
    autograd: tuple[Callable, Callable] | None = None


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


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What dispatch would do for one call (`glm5_hal.explain`)."""
    op: str
    args: str
    key: tuple
    chosen: str | None
    rejected: tuple[tuple[str, str], ...]
    fallback: bool
    error: str | None = None

    def __str__(self) -> str:
        lines = [f"{self.op}({self.args})"]
        if self.error:
            lines.append(f"  error: {self.error}")
        else:
            lines.append(f"  chosen: {self.chosen}" + ("  [fallback]" if self.fallback else ""))
        for who, why in self.rejected:
            lines.append(f"  rejected {who}: {why}")
        return "\n".join(lines)


_PIN: contextvars.ContextVar[str | None] = contextvars.ContextVar("glm5_hal_pin", default=None)
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")


@dataclasses.dataclass
class _Loaded:
    settings: Settings
    backends: dict[str, Backend]
    outcomes: list[PluginOutcome]
    by_device: dict[str, list[Backend]]  # available non-reference backends, best first


@dataclasses.dataclass
class _Decision:
    candidates: tuple[Impl, ...]        # tried in order, reference last
    static_rejections: tuple[tuple[Backend, str], ...]  # counted as fallbacks if the reference runs
    vendor_available: bool              # a non-reference backend of this device type is usable
    error: str | None = None            # strict mode: the call must raise this


class Registry:
    """The process-wide op table and backend set."""

    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}
        self._lock = threading.RLock()
        self._loaded: _Loaded | None = None
        self._host: PluginHost | None = None
        self._runtime_plugins: dict[str, Any] = {}
        self._fallback_counts: collections.Counter = collections.Counter()
        self._warned: set[tuple[str, str, str]] = set()

    # -- ops ---------------------------------------------------------------------------
    def define(self, opdef: OpDef) -> "Op":
        if opdef.name in self.ops:
            raise HalError(f"op {opdef.name!r} defined twice")
        op = Op(self, opdef)
        self.ops[opdef.name] = op
        return op

    def op(self, name: str) -> "Op":
        _ensure_ops_imported()
        try:
            return self.ops[name]
        except KeyError:
            raise UnsupportedOpError(f"unknown op {name!r}; known ops: {sorted(self.ops)}") from None

    # -- plugins -----------------------------------------------------------------------
    def loaded(self) -> _Loaded:
        loaded = self._loaded
        if loaded is None:
            with self._lock:
                if self._loaded is None:
                    self._loaded = self._load()
                loaded = self._loaded
        return loaded

    def _load(self) -> _Loaded:
        _ensure_ops_imported()
        settings = Settings.from_env()
        host = PluginHost(lambda: set(self.ops))
        outcomes: list[PluginOutcome] = []
        backends: dict[str, Backend] = {}
        entry_points = host.entry_points()
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
        self._host = host
        return _Loaded(settings, backends, outcomes, dict(by_device))

    def reload(self) -> None:
        """Forget loaded plugins, decisions and counters; re-read the environment on next use."""
        with self._lock:
            self._loaded = None
            self._host = None
            self._fallback_counts.clear()
            self._warned.clear()
            for op in self.ops.values():
                op._clear()

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
                ops=tuple(sorted(b._impls)), error=None,
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
        token = _PIN.set(name)
        try:
            yield backend
        finally:
            _PIN.reset(token)

    def fallback_stats(self) -> dict[tuple[str, str, str], int]:
        return dict(self._fallback_counts)

    # -- decisions ---------------------------------------------------------------------
    def decide(self, op: "Op", key: tuple) -> _Decision:
        loaded = self.loaded()
        device_type, dtype, pin = key[0], key[1], key[2]
        if pin is not None:
            pinned = loaded.backends[pin]
            considered = [] if pin == REFERENCE else [pinned]
        else:
            considered = loaded.by_device.get(device_type, [])
        candidates: list[Impl] = []
        rejected: list[tuple[Backend, str]] = []
        for b in considered:
            reason = _static_rejection(b, op.name, device_type, dtype)
            if reason is None:
                candidates.append(b._impls[op.name])
            else:
                rejected.append((b, reason))
        ref_backend = loaded.backends.get(REFERENCE)
        ref = ref_backend._impls.get(op.name) if ref_backend is not None else None
        if ref is None:  # an install without the reference entry point still dispatches
            ref = Impl(op.name, _ORPHAN_REFERENCE, op.opdef.reference, None, None)
        candidates.append(ref)
        vendor = bool(considered) and any(b.availability().available and b.device_type == device_type
                                          for b in considered)
        error = None
        if loaded.settings.strict and vendor and len(candidates) == 1:
            error = _fallback_message(op.name, device_type, dtype, rejected)
        return _Decision(tuple(candidates), tuple(rejected), vendor, error)

    def record_fallback(self, op: str, rejections: list[tuple[Backend, str]]) -> None:
        for backend, reason in rejections:
            k = (op, backend.name, reason)
            self._fallback_counts[k] += 1
            if k not in self._warned:
                self._warned.add(k)
                warnings.warn(f"glm5_hal: {op} runs the reference implementation: backend "
                              f"{backend.name!r} declined: {reason}", FallbackWarning, stacklevel=4)


def _static_rejection(b: Backend, op: str, device_type: str, dtype: torch.dtype) -> str | None:
    if b.device_type != device_type and b.device_type != ANY_DEVICE:
        return f"takes {b.device_type} tensors, the call has {device_type} tensors"
    avail = b.availability()
    if not avail.available:
        return f"unavailable: {avail.reason}"
    impl = b._impls.get(op)
    if impl is None:
        return f"does not implement {op}"
    if impl.dtypes is not None and dtype not in impl.dtypes:
        return f"implements {op} for {_dtypes(impl.dtypes)}, not {_dtype(dtype)}"
    caps = b.cached_capabilities()
    if dtype.is_floating_point and caps.dtypes and dtype not in caps.dtypes:
        return (f"device {caps.device_name or b.device_type} does not support {_dtype(dtype)} "
                f"(capabilities: {_dtypes(caps.dtypes)})")
    return None


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


class Op:
    """A callable op: the thin public functions in `glm5_hal.ops` call one of these."""

    def __init__(self, registry: Registry, opdef: OpDef):
        self.registry = registry
        self.opdef = opdef
        self.name = opdef.name
        self.signature = inspect.signature(opdef.reference)
        params = list(self.signature.parameters)
        if opdef.dispatch_arg not in params:
            raise HalError(f"op {opdef.name}: dispatch_arg {opdef.dispatch_arg!r} is not a parameter")
        self._dispatch_index = params.index(opdef.dispatch_arg)
        self._check = opdef.check
        self._check_values = opdef.check_values
        self._key_extra = opdef.key_extra
        self._differentiable = opdef.differentiable or opdef.autograd is not None
        self._direct: dict[tuple, Callable] = {}
        self._decisions: dict[tuple, _Decision] = {}
        self._register_torch_op()
        self.torch_op = getattr(getattr(torch.ops, NAMESPACE), opdef.name).default

    # The hot path. Keep it short: every statement here is paid on every call.
    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._via_torch(args)
        if self._differentiable and torch.is_grad_enabled() and _needs_grad(args):
            return self._via_torch(args)
        return self.dispatch(args)

    def dispatch(self, args: tuple) -> Any:
        self._check(*args)
        a = args[self._dispatch_index]
        key = (a.device.type, a.dtype, _PIN.get())
        if self._key_extra is not None:
            key += self._key_extra(*args)
        fn = self._direct.get(key)  # runs check_values first unless the kernel validates itself
        if fn is not None:
            return fn(*args)
        if self._check_values is not None:
            self._check_values(*args)
        return self._dispatch_slow(key, args)

    def _dispatch_slow(self, key: tuple, args: tuple) -> Any:
        decision = self._decision(key)
        impl, rejections = _select(decision, args)
        if impl.backend.name == REFERENCE and decision.vendor_available and rejections:
            if self.registry.loaded().settings.strict:
                raise UnsupportedOpError(decision.error or _fallback_message(
                    self.name, key[0], key[1], rejections))
            self.registry.record_fallback(self.name, rejections)
        return impl.fn(*args)

    def _decision(self, key: tuple) -> _Decision:
        decision = self._decisions.get(key)
        if decision is None:
            decision = self.registry.decide(self, key)
            first = decision.candidates[0]
            if first.supports is None and not (decision.static_rejections and decision.vendor_available
                                                and first.backend.name == REFERENCE):
                fn = first.fn
                if self._check_values is not None and not first.validates_values:
                    fn = _values_checked(self._check_values, fn)
                self._direct[key] = fn
            self._decisions[key] = decision
        return decision

    def explain(self, *args: Any, **kwargs: Any) -> Explanation:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        args = tuple(bound.arguments.values())
        described = describe_args(args)
        try:
            self._check(*args)
            if self._check_values is not None:
                self._check_values(*args)
        except InvalidInputError as exc:
            return Explanation(self.name, described, (), None, (), False, str(exc))
        a = args[self._dispatch_index]
        key = (a.device.type, a.dtype, _PIN.get())
        if self._key_extra is not None:
            key += self._key_extra(*args)
        decision = self._decision(key)
        impl, rejections = _select(decision, args)
        fallback = impl.backend.name == REFERENCE and decision.vendor_available and bool(rejections)
        rows = tuple((f"{b.name}.{self.name}", r) for b, r in rejections)
        return Explanation(self.name, described, key, impl.qualname, rows, fallback,
                           decision.error if fallback else None)

    def _clear(self) -> None:
        self._direct.clear()
        self._decisions.clear()

    # -- torch.library ------------------------------------------------------------------
    def _via_torch(self, args: tuple) -> Any:
        flat = self.opdef.to_torch(*args) if self.opdef.to_torch else args
        return self.torch_op(*flat)

    def _register_torch_op(self) -> None:
        opdef = self.opdef
        qualname = f"{NAMESPACE}::{opdef.name}"
        if "=" in opdef.schema:
            # torch drops trailing arguments equal to their schema default before calling
            # the kernel, so check(*args) would see a short argument list. The Python
            # functions keep the defaults; the schema must not have any.
            raise HalError(f"op {opdef.name}: torch schema must not declare defaults: {opdef.schema}")
        _LIBRARY.define(opdef.name + opdef.schema)
        from_torch = opdef.from_torch

        def kernel(*flat):
            return self.dispatch(from_torch(*flat) if from_torch else flat)

        def fake(*flat):
            args = from_torch(*flat) if from_torch else flat
            opdef.check(*args)
            return opdef.fake(*args)

        _LIBRARY.impl(opdef.name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(qualname, fake, lib=_LIBRARY)
        if self._differentiable:
            backward, setup_context = opdef.autograd or _reference_vjp(opdef)
            torch.library.register_autograd(qualname, backward, setup_context=setup_context,
                                            lib=_LIBRARY)


def _values_checked(check_values: Callable[..., None], fn: Callable) -> Callable:
    def checked(*args: Any) -> Any:
        check_values(*args)
        return fn(*args)
    return checked


def _select(decision: _Decision, args: tuple) -> tuple[Impl, list[tuple[Backend, str]]]:
    """The implementation a call gets, and every rejection on the way (static ones first)."""
    rejections = list(decision.static_rejections)
    for impl in decision.candidates:
        if impl.supports is None:
            return impl, rejections
        try:
            verdict = impl.supports(*args)
        except Exception as exc:
            verdict = f"supports() raised {type(exc).__name__}: {exc}"
        if verdict is True:
            return impl, rejections
        rejections.append((impl.backend, verdict if isinstance(verdict, str)
                           else f"supports() returned {verdict!r}"))
    raise AssertionError("the reference implementation is always the last candidate")


def _reference_vjp(opdef: OpDef) -> tuple[Callable, Callable]:
    """A backward for `opdef` that recomputes its reference under autograd and returns the
    vector-Jacobian product with respect to every floating-point tensor input."""

    def setup_context(ctx, inputs, output):
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in inputs]
        ctx.values = [None if t else a for t, a in zip(ctx.is_tensor, inputs)]
        ctx.save_for_backward(*[a for a in inputs if isinstance(a, torch.Tensor)])

    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        flat = [next(saved) if t else v for t, v in zip(ctx.is_tensor, ctx.values)]
        wanted = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)
                  and a.is_floating_point() and ctx.needs_input_grad[i]]
        result: list[Any] = [None] * len(flat)
        if not wanted:
            return tuple(result)
        with torch.enable_grad():
            for i in wanted:
                flat[i] = flat[i].detach().requires_grad_()
            args = opdef.from_torch(*flat) if opdef.from_torch else flat
            out = opdef.reference(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            got = torch.autograd.grad([o for o, _ in pairs], [flat[i] for i in wanted],
                                      [g for _, g in pairs], allow_unused=True)
            for i, g in zip(wanted, got):
                result[i] = g
        return tuple(result)

    return backward, setup_context


def _needs_grad(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


_OPS_IMPORTED = False


def _ensure_ops_imported() -> None:
    global _OPS_IMPORTED
    if not _OPS_IMPORTED:
        _OPS_IMPORTED = True
        import glm5_hal.ops  # noqa: F401  (defines every op on import)


REGISTRY = Registry()
define = REGISTRY.define


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
    return REGISTRY.op(name).explain(*args, **kwargs)


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
