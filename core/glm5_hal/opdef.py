"""What an op is: its reference implementation, input contract and fake, its torch custom op,
and the code every call runs.

`define(reference, args=..., fake=...)` is the whole definition of an op. The name,
parameters, defaults and torch schema come from the reference's annotated signature
(`torch.library.infer_schema`; an `Fp8Pair` argument becomes two schema arguments); the contract
(glm5_hal.contract) is compiled into the public function, so a call runs, inline:

1. under a PyTorch transform (dynamo, a torch dispatch or function mode such as make_fx's or
   FakeTensorMode, a functorch level: vmap, grad, jvp, functionalize; forward-mode AD;
   torch.jit.trace; a tensor subclass), or when autograd needs it, the torch custom op `torch.ops.glm5_hal.<op>`, whose
   kernel is steps 2-3 and whose fake checks the inputs too (under functionalize an in-place
   op writes copies, see `_functionalized`). Under torch.func's grad / jvp and forward-mode AD
   a differentiable op is differentiated by the custom op's Autograd kernel
   (`_autograd_kernel`), which applies its autograd.Function at the functorch level being
   differentiated, whether the call came through the public function or torch.ops directly;
2. the metadata checks (raising InvalidInputError), which also yield the decision key
   (device, dtype of the first tensor argument, pinned backend, FP8-pair flags). They are a
   pure function of what glm5_hal._C.call_key reads (each tensor's dtype, device, sizes and the
   flags the check reads, the scalars with their types, the pin), so a call whose call key
   passed before skips them and takes the decision key remembered for it (`_admit`); a call
   call_key cannot read exactly (a tensor subclass, a scalar of another type) or made under a
   transform (call_key gives no key then) runs them, then step 1 if it is transformed;
3. the implementation remembered with the call key when one serves every call with that
   call key (no per-call `supports` predicate, a metadata-only one accepted: `_remember`);
   otherwise the slow path: the decision (made once per key by the dispatcher, glm5_hal.registry),
   per-call `supports` predicates in order, fallback accounting, the op's value checks
   unless the chosen kernel validates values itself, then the implementation.

Three things are keys here, each named for what it is: an `Fp8Pair` argument (indexer keys,
a tensor or an FP8 (values, scale) pair: glm5_hal.contract); the *decision key* (device, dtype,
pin, FP8-pair flags: what the dispatcher decides once for); the *call key* (glm5_hal._C.call_key:
all the metadata the check reads, under which a passed check is remembered).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import sys
import typing
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad

from .backend import REFERENCE, Backend, Impl, describe_args
from .contract import ArgSpec, Compiled, Fp8Pair, Out, Rule, Tensor, compile_contract, key_scale_name
from .errors import HalError, InvalidInputError

NAMESPACE = "glm5_hal"

#: every defined op by name, in definition order
OPS: dict[str, "Op"] = {}

try:
    from ._C import call_key as _call_key
except ImportError:   # a source tree without the native extension: every call runs its check
    _call_key = None

#: call keys remembered per op (Op._remember)
_PASSED_LIMIT = 1024
_torch_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_levels = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._get_tracing_state
#: the tensor types the eager path serves itself (call_key reads exactly these)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

_PIN: contextvars.ContextVar[str | None] = contextvars.ContextVar("glm5_hal_pin", default=None)
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")


@contextlib.contextmanager
def pinned(backend: str | None) -> Iterator[None]:
    """Dispatch in this context considers only `backend` (then the reference)."""
    token = _PIN.set(backend)
    try:
        yield
    finally:
        _PIN.reset(token)


#: tensor subclasses and modes that emulate a device rather than transform a program
#: (register_device_emulation)
_DEVICE_EMULATION: set[type] = set()


def register_device_emulation(*types: type) -> None:
    """Declares tensor subclasses and torch function / dispatch modes that stand in for a
    device (a test harness presenting CPU tensors as device tensors) rather than transform a
    program: calls with them take the eager path, as calls with real device tensors do, so
    that what the harness observes is that path."""
    _DEVICE_EMULATION.update(types)


def _transformed(*args: Any) -> bool:
    """Whether a call must reach the op through torch's dispatcher (torch.ops.glm5_hal.*)
    rather than the eager path: a PyTorch transform is active (a torch dispatch mode such as
    FakeTensorMode or make_fx's proxy mode, a torch function mode, a functorch level: vmap,
    grad, jvp, functionalize; forward-mode AD; torch.jit.trace; compiling or exporting), or a
    tensor argument is a subclass (FakeTensor, FunctionalTensor, ...). Such tensors may be
    wrappers without data of their own, and the transform must see the op to trace, batch or
    differentiate it. Device emulation (register_device_emulation) is not a transform."""
    if (_functorch_levels() or _forward_ad._current_level >= 0 or torch.compiler.is_compiling()
            or _jit_tracing() is not None):
        return True
    if _dispatch_modes() and not _emulation_only(_dispatch_mode_stack()):
        return True
    if _torch_function_mode() and not _emulation_only(_function_mode_stack()):
        return True
    for a in args:
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(t, torch.Tensor) and type(t) not in _PLAIN_TENSORS \
                    and type(t) not in _DEVICE_EMULATION:
                return True
    return False


def _emulation_only(modes: list) -> bool:
    return bool(_DEVICE_EMULATION) and all(type(m) in _DEVICE_EMULATION for m in modes)


def _dispatch_mode_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return _get_current_dispatch_mode_stack()


def _function_mode_stack() -> list:
    from torch.overrides import _get_current_function_mode_stack
    return _get_current_function_mode_stack()


_FUNCTIONALIZE = torch._C._functorch.TransformType.Functionalize
_GRAD, _JVP = torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp


def _innermost_transform() -> Any:
    """The innermost functorch transform's TransformType (None outside functorch)."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    return None if interpreter is None else interpreter.key()


@dataclasses.dataclass(frozen=True)
class Decision:
    """What dispatch does for one decision key, made once by the dispatcher."""
    candidates: tuple[Impl, ...]        # tried in order, the reference last
    static_rejections: tuple[tuple[Backend, str], ...]  # counted as fallbacks if the reference runs
    vendor_available: bool              # a non-reference backend of this device type is usable
    check_values: Callable[..., None] | None  # the op's value checks, when they run for this key
    error: str | None = None            # strict mode: a fallback must raise this


class Dispatcher(Protocol):
    """What ops need from the registry (installed with `set_dispatcher`)."""

    def decide(self, op: "Op", decision_key: tuple) -> Decision: ...

    def fallback(self, op: "Op", decision_key: tuple, decision: Decision,
                 rejections: list[tuple[Backend, str]]) -> None: ...


_dispatcher: Dispatcher | None = None


def set_dispatcher(dispatcher: Dispatcher) -> None:
    global _dispatcher
    _dispatcher = dispatcher


def dispatcher() -> Dispatcher:
    if _dispatcher is None:
        raise HalError("no dispatcher installed: import glm5_hal.ops (or glm5_hal.registry) first")
    return _dispatcher


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What dispatch would do for one call (`glm5_hal.explain`)."""
    op: str
    args: str
    key: tuple                          # the decision key
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


def define(reference: Callable, *, args: dict[str, ArgSpec], fake: Callable,
           rules: Sequence[Rule] = (), check_values: Callable[..., None] | None = None,
           mutates: Sequence[str] = (), differentiable: bool = False,
           autograd: tuple[Callable, ...] | None = None, doc: str | None = None,
           name: str | None = None, out: Out | None = None) -> Callable:
    """Defines an op and returns its public function.

    reference: the reference implementation; its name and annotated signature are the op's.
    args, rules: the input contract (glm5_hal.contract); the first tensor argument keys dispatch.
    fake: the fake (meta) implementation, with the reference's parameters.
    check_values: data-dependent validation `check_values(*args)` (index ranges), raising
        InvalidInputError before anything is written. It runs on CPU tensors, and on other
        devices only under GLM5_HAL_CHECKS=full (reading device data would synchronise), and
        never before an implementation declared `validates_values=True`.
    mutates: the arguments written in place.
    differentiable: the op has a backward; unless `autograd` gives one, it is the
        vector-Jacobian product of the reference (recomputed in the backward pass).
    autograd: (backward, setup_context[, jvp]) as for torch.library.register_autograd, plus
        the forward-mode rule `jvp(inputs, tangents) -> output tangent(s)` (None: the
        reference's Jacobian-vector product, which must then agree with `backward`).
    doc: the public function's docstring: every argument's shape and dtype, and the result.
    out: the public function takes a keyword-only `out=` buffer for its (first) result, of
        this shape and dtype (glm5_hal.contract.Out; `Op.call_with_out` says what a call with
        one does). The torch custom op stays functional.
    """
    op = Op(name or reference.__name__, reference, args, rules, fake, check_values, mutates,
            differentiable or autograd is not None, autograd, out)
    if op.name in OPS:
        raise HalError(f"op {op.name!r} defined twice")
    OPS[op.name] = op
    public = op.public
    public.__doc__ = doc
    public.__module__ = sys._getframe(1).f_globals.get("__name__", __name__)
    return public


def defined_in(module: str) -> list[str]:
    """The names of the ops defined by `module`, in definition order (a family's __all__)."""
    return [name for name, op in OPS.items() if op.public.__module__ == module]


def lookup(name: str) -> "Op":
    """The op called `name` (UnsupportedOpError naming the known ones if there is none)."""
    try:
        return OPS[name]
    except KeyError:
        from .errors import UnsupportedOpError
        known = sorted(OPS) or "none yet (import glm5_hal.ops, which defines them)"
        raise UnsupportedOpError(f"unknown op {name!r}; known ops: {known}") from None


class Op:
    """One op: its definition, its torch custom op, and its dispatch state (decisions and
    the implementations called straight from the generated public function)."""

    def __init__(self, name: str, reference: Callable, args: dict[str, ArgSpec],
                 rules: Sequence[Rule], fake: Callable, check_values: Callable[..., None] | None,
                 mutates: Sequence[str], differentiable: bool,
                 autograd: tuple[Callable, ...] | None, out: Out | None = None) -> None:
        self.name = name
        self.reference = reference
        self.fake = fake
        self.check_values = check_values
        self.mutates = tuple(mutates)
        self.differentiable = differentiable
        self.signature = inspect.signature(reference)
        self.params = tuple(self.signature.parameters)
        self.out = out
        self.contract: Compiled = compile_contract(name, self.params, args, rules, out)
        self.pairs = tuple(p for p in self.params if isinstance(args[p], Fp8Pair))
        self.schema = _infer_schema(name, reference, self.signature, self.pairs, mutates)
        self._direct: dict[tuple, Callable] = {}
        self._decisions: dict[tuple, Decision] = {}
        self._passed: dict[tuple, tuple] = {}
        self._grad_args = tuple(p for p in self.params if isinstance(args[p], (Tensor, Fp8Pair)))
        self._optional = frozenset(p for p in self.params
                                   if isinstance(args[p], Tensor) and args[p].optional)
        self.check, self.public, self.kernel = self._generate()
        self.check_out = self._generate_out_check() if out is not None else None
        # call_key's plan for a call with a buffer: the inputs', then `out`'s (contiguity
        # read), every requires_grad flag read (_remember_out)
        plan = self.contract.plan
        self._out_plan = (plan.upper() + b"C" if out is not None and plan is not None
                          and _call_key is not None else None)
        self._passed_out: dict[tuple, tuple] = {}
        self._functionalized: Callable | None = None
        self._register_torch_op(mutates, autograd)
        self.torch_op = getattr(getattr(torch.ops, NAMESPACE), name).default

    # -- the generated functions -----------------------------------------------------------
    def _generate(self) -> tuple[Callable, Callable, Callable]:
        c = self.contract
        params = ", ".join(self.params)
        call = f"({params},)"
        key = f"({c.device}, {c.dtype}, _pin()" + "".join(f", {f}" for f in c.pair_flags) + ")"
        body = [f"    {line}" for line in c.lines]
        needs_grad = (" or ".join(self._requires_grad(p) for p in self._grad_args)
                      if self.differentiable else "")
        decide = [f"    _fn = _direct_get(_key)",
                  "    if _fn is not None:",
                  f"        return _fn({params})",
                  f"    return _slow(_key, {call})"]
        defaults = ", ".join(_with_default(p) for p in self.signature.parameters.values())
        flat = ", ".join(self.torch_params())
        join = [f"    {p} = {p} if {key_scale_name(p)} is None else ({p}, {key_scale_name(p)})"
                for p in self.pairs]
        # dynamo traces this function's bytecode: it must see the custom op, not call_key
        head = [f"def {self.name}({defaults}):",
                "    if _dynamo_compiling():",
                f"        return _torch_call({params})"]
        if self.out is not None:
            # out=None costs this one test; a buffer takes Op.call_with_out
            head = [f"def {self.name}({defaults}, *, out=None):",
                    "    if out is not None:",
                    f"        return _with_out(out, {params})", *head[1:]]
        # under a transform (a dispatch or function mode, a functorch level, a tensor subclass)
        # the call goes through torch's dispatcher, after the same checks
        transformed = [f"    if _transformed({params}):", f"        return _via_torch({params})"]
        if c.plan is not None and _call_key is not None:
            # a call whose metadata (its call key) passed the check before skips it (see
            # _admit); call_key gives no key under a transform
            plan = c.plan.upper() if self.differentiable else c.plan
            lookup = [f"    _hit = _passed_get(_call_key({plan!r}, _pin(), {params}))"]
            # the hit remembers, per call key, the decision key, whether the call needs
            # autograd, and the implementation when one serves every call with that key
            remembered = ["    if _fn is not None:",
                          f"        return _fn({params})",
                          f"    return _slow(_key, {call})"]
            checked = [*lookup,
                       "    if _hit is None:",
                       f"        return _unkeyed({params})",
                       "    _key, _needs_grad, _fn = _hit"]
            kernel_checked = [*lookup,
                              "    if _hit is None:",
                              f"        _hit = _admit({params})",
                              "    _key, _needs_grad, _fn = _hit"]
            grad = ["    if _needs_grad and _grad_enabled():", f"        return _via_torch({params})"]
            admit = ["", f"def _admit({params}):", *body,
                     f"    _key = {key}",
                     f"    return _remember(_call_key({plan!r}, _key[2], {params}), _key, "
                     f"{needs_grad or 'False'}, {call})",
                     "",
                     f"def _unkeyed({params}):",
                     f"    _key, _needs_grad, _fn = _admit({params})",
                     *transformed,
                     *(grad if self.differentiable else []), *remembered]
        else:
            remembered = decide
            checked = [*body, f"    _key = {key}", *transformed]
            kernel_checked = [*body, f"    _key = {key}"]
            grad = [f"    if _grad_enabled() and ({needs_grad}):", f"        return _via_torch({params})"]
            admit = []
        source = "\n".join([
            f"def check({params}):", *body, f"    return {_key_without_pin(key)}",
            "",
            *head, *checked, *(grad if self.differentiable else []), *(remembered if admit else decide),
            *admit,
            "",
            # the torch custom op's kernel: torch's dispatcher has applied any transform and
            # autograd by the time it runs, so it goes straight to the implementation
            f"def kernel({flat}):",
            *join, *kernel_checked, *(remembered if admit else decide),
        ])
        ns = dict(c.namespace)
        ns.update(_dynamo_compiling=torch.compiler.is_dynamo_compiling, _transformed=_transformed,
                  _grad_enabled=torch.is_grad_enabled,
                  _pin=_PIN.get, _direct_get=self._direct.get, _slow=self.slow,
                  _via_torch=self.via_torch, _torch_call=self.torch_call, _call_key=_call_key, _passed_get=self._passed.get,
                  _remember=self._remember, _with_out=self.call_with_out)
        ns.update({f"_default_{p.name}": p.default for p in self.signature.parameters.values()
                   if p.default is not inspect.Parameter.empty})
        code = compile(source, f"<glm5_hal op {self.name}>", "exec")
        exec(code, ns)
        self.source = source
        public = ns[self.name]
        public.__qualname__ = self.name
        public.op = self
        return ns["check"], public, ns["kernel"]

    def _generate_out_check(self) -> Callable:
        """`check_out(*args, out)`: the input check, then the `out` buffer's (contract.Out);
        returns the decision key without the pin, as `check` does."""
        c = self.contract
        params = ", ".join(self.params)
        key = f"({c.device}, {c.dtype}" + "".join(f", {f}" for f in c.pair_flags) + ")"
        source = "\n".join([f"def check_out({params}, out):",
                            *[f"    {line}" for line in (*c.lines, *c.out_lines)],
                            f"    return {key}"])
        ns = dict(c.namespace)
        exec(compile(source, f"<glm5_hal op {self.name} out check>", "exec"), ns)
        return ns["check_out"]

    def call_with_out(self, out: Any, *args: Any) -> Any:
        """A call with an `out=` buffer, as torch's out= variants behave: everything (the
        inputs, then `out`: exact dtype and shape, the dispatch device, dense and contiguous,
        no memory shared with an input; no autograd recording the call) is checked before
        anything is written, and the call returns `out` itself (for an op returning a tuple:
        the tuple with `out` first).

        Eagerly an implementation that takes `out` (Impl.takes_out) writes its result there;
        another's result is copied in. Under a transform the functional torch custom op runs
        and its result is copied in with `out.copy_`, so the transform sees ordinary aten ops
        (the memory check needs data pointers, which a transform's tensors may lack: it runs
        eagerly only)."""
        if torch.compiler.is_dynamo_compiling():   # dynamo traces this: the custom op, then copy_
            self.check_out(*args, out)
            self._refuse_autograd(out, args)
            return self._into(out, self.torch_call(*args))
        call_key = None if self._out_plan is None else _call_key(self._out_plan, _PIN.get(), *args, out)
        hit = None if call_key is None else self._passed_out.get(call_key)
        if hit is None:
            # the checks in full (and the transforms, under which call_key gives no key)
            decision_key = self.check_out(*args, out)
            self._refuse_autograd(out, args)
            if _transformed(out, *args):
                return self._into(out, self.via_torch(*args))
            decision_key = (decision_key[0], decision_key[1], _PIN.get(), *decision_key[2:])
            hit = self._remember_out(call_key, decision_key, out, args)
        elif hit[1] and torch.is_grad_enabled():
            self._refuse_autograd(out, args)
        decision_key, _, impl, check_values = hit
        # addresses and inference mode change from call to call: never remembered
        if out.is_inference() and not _inference_mode():
            raise InvalidInputError(self.name, "out", "a normal tensor, or an inference tensor inside "
                                    "torch.inference_mode() (torch refuses in-place writes to inference "
                                    "tensors outside it)", "an inference tensor outside inference mode")
        _refuse_overlap(self, out, args)
        if impl is None:   # the slow path: per-call predicates, fallback accounting
            impl, check_values = self._select(decision_key, args)
        if check_values is not None:
            check_values(*args)
        if not impl.takes_out:
            return self._into(out, impl.fn(*args))
        result = impl.fn(*args, out=out)
        # written outside autograd: bump the version as an in-place op would, so that a graph
        # that saved `out` earlier refuses its backward instead of reading the new values
        _increment_version((out,))
        return (out, *result[1:]) if isinstance(result, tuple) else out

    def _remember_out(self, call_key: tuple | None, decision_key: tuple, out: torch.Tensor, args: tuple) -> tuple:
        """What a call with an out= buffer that passed the checks needs again, kept under its
        call key (the inputs' and the buffer's metadata, requires_grad flags included):
        (decision key, whether a tensor requires grad, the implementation when one serves
        every call with that key or None, the value checks to run before it or None)."""
        tracks_grad = any(t.requires_grad for a in (out, *args)
                          for t in (a if isinstance(a, (tuple, list)) else (a,)) if isinstance(t, torch.Tensor))
        impl, check_values = self._serving_every_call(decision_key, args) or (None, None)
        hit = (decision_key, tracks_grad, impl, check_values)
        if call_key is not None and not _torch_function_mode():
            if len(self._passed_out) >= _PASSED_LIMIT:
                self._passed_out.clear()
            self._passed_out[call_key] = hit
        return hit

    @staticmethod
    def _into(out: torch.Tensor, result: Any) -> Any:
        if isinstance(result, tuple):
            out.copy_(result[0])
            return (out, *result[1:])
        out.copy_(result)
        return out

    def _refuse_autograd(self, out: torch.Tensor, args: tuple) -> None:
        """out= with autograd recording is refused, as torch refuses it ("functions with out=...
        arguments don't support automatic differentiation"): the result would not carry the
        graph, and a native write into `out` bypasses autograd."""
        if not torch.is_grad_enabled():
            return
        if out.requires_grad:
            raise InvalidInputError(self.name, "out", "a tensor that does not require grad while grad "
                                    "mode is on (out= does not support automatic differentiation)",
                                    "out.requires_grad=True")
        if not self.differentiable:
            return
        for p, a in zip(self.params, args):
            for t in (a if isinstance(a, (tuple, list)) else (a,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    raise InvalidInputError(self.name, "out", "None when an input requires grad and grad "
                                            "mode is on (out= does not support automatic differentiation; "
                                            "call under torch.no_grad() or without out=)",
                                            f"a buffer, with {p!r} requiring grad")

    def _remember(self, call_key: tuple | None, decision_key: tuple, needs_grad: bool, args: tuple) -> tuple:
        """The hit for a call that passed the check: (decision key, whether it needs
        autograd, the implementation serving every call with this call key or None), kept for
        calls with the same call key. Bounded: shapes that change every call (a growing
        context) start it over rather than grow it."""
        if call_key is None or _torch_function_mode():
            # no call key; or, under a torch function mode, the check read what the mode answered
            # for the tensors, which the call key (read from the tensors themselves) need not match
            return decision_key, needs_grad, None
        hit = (decision_key, needs_grad, self._implementation_for(decision_key, args))
        if len(self._passed) >= _PASSED_LIMIT:
            self._passed.clear()
        self._passed[call_key] = hit
        return hit

    def _implementation_for(self, decision_key: tuple, args: tuple) -> Callable | None:
        """The function every call with these arguments' call key gets, if that needs nothing
        per call: the first candidate whose metadata-only predicate (`supports_metadata`,
        a function of what the call key holds) accepts, with the op's value checks in front
        where they run. None where a call needs more: a per-call `supports` predicate on the
        way, or a rejection (fallback accounting and warnings count calls)."""
        try:
            self.decision(decision_key)
        except HalError:
            return None   # the slow path raises it, in its place
        direct = self._direct.get(decision_key)
        if direct is not None:
            return direct
        serving = self._serving_every_call(decision_key, args)
        if serving is None:
            return None
        impl, check_values = serving
        return impl.fn if check_values is None else _values_checked(check_values, impl.fn, self.params)

    def _serving_every_call(self, decision_key: tuple, args: tuple) -> tuple[Impl, Callable | None] | None:
        """(implementation, value checks to run before it or None) when one implementation
        serves every call with these arguments' call key: the first candidate, if it has no
        per-call `supports` and its metadata-only predicate (`supports_metadata`, a function of
        what the call key holds) accepts. None where a call needs more (a per-call predicate,
        a rejection: fallback accounting and warnings count calls) or the decision raises
        (the slow path raises it, in its place)."""
        try:
            decision = self.decision(decision_key)
        except HalError:
            return None
        if decision.static_rejections:
            return None
        impl = decision.candidates[0]
        if impl.needs_per_call_check or (impl.supports_metadata is not None
                                         and _verdict(impl.supports_metadata, args) is not True):
            return None
        return impl, _value_checks_before(decision, impl)

    def _requires_grad(self, p: str) -> str:
        if p in self.pairs:
            return f"(not _pair_{p} and {p}.requires_grad)"
        if p in self._optional:
            return f"({p} is not None and {p}.requires_grad)"
        return f"{p}.requires_grad"

    def torch_params(self) -> list[str]:
        """The torch schema's parameter names (an `Fp8Pair` argument is two)."""
        out = []
        for p in self.params:
            out.append(p)
            if p in self.pairs:
                out.append(key_scale_name(p))
        return out

    # -- torch.library ------------------------------------------------------------------------
    def to_torch(self, args: tuple) -> tuple:
        """Canonical arguments as the torch schema's flat arguments."""
        if not self.pairs:
            return tuple(args)
        flat: list[Any] = []
        for p, a in zip(self.params, args):
            if p in self.pairs:
                flat.extend(a if isinstance(a, (tuple, list)) else (a, None))
            else:
                flat.append(a)
        return tuple(flat)

    def from_torch(self, flat: tuple) -> tuple:
        if not self.pairs:
            return tuple(flat)
        args, it = [], iter(flat)
        for p in self.params:
            a = next(it)
            if p in self.pairs:
                scale = next(it)
                a = a if scale is None else (a, scale)
            args.append(a)
        return tuple(args)

    def torch_call(self, *args: Any) -> Any:
        """The call through torch.ops.glm5_hal.<op> (what dynamo traces)."""
        return self.torch_op(*self.to_torch(args))

    def via_torch(self, *args: Any) -> Any:
        """The call through torch's dispatcher (torch.ops.glm5_hal.<op>), whose Autograd kernel
        (`_autograd_kernel`) serves functorch's grad / jvp and forward-mode AD; under
        functionalize an in-place op writes copies (`_functionalized`)."""
        if self._functionalized is not None and _innermost_transform() == _FUNCTIONALIZE:
            return self._functionalized(*self.to_torch(args))
        return self.torch_op(*self.to_torch(args))

    def _register_torch_op(self, mutates: Sequence[str], autograd) -> None:
        qualname = f"{NAMESPACE}::{self.name}"
        _LIBRARY.define(self.name + self.schema)
        _LIBRARY.impl(self.name, self.kernel, "CompositeExplicitAutograd")

        def fake(*flat):
            args = self.from_torch(flat)
            self.check(*args)
            return self.fake(*args)

        torch.library.register_fake(qualname, fake, lib=_LIBRARY)
        if mutates:
            # torch's generic fallbacks refuse ops that write their arguments
            written = [self.torch_params().index(p) for p in mutates]
            torch.library.register_vmap(qualname, _looped_vmap(self, written), lib=_LIBRARY)
            self._functionalized = _functionalized(self, written)
        if self.differentiable:
            backward, setup_context, *forward_rule = autograd or _reference_vjp(self)
            jvp = forward_rule[0] if forward_rule and forward_rule[0] else _reference_jvp(self)
            function = _autograd_function(self, backward, setup_context, jvp)
            _LIBRARY.impl(self.name, _autograd_kernel(self, function, jvp), "Autograd")

    # -- dispatch ------------------------------------------------------------------------------
    def slow(self, decision_key: tuple, args: tuple) -> Any:
        impl, check_values = self._select(decision_key, args)
        if check_values is not None:
            check_values(*args)
        return impl.fn(*args)

    def _select(self, decision_key: tuple, args: tuple) -> tuple[Impl, Callable | None]:
        """Per call: the first candidate whose predicates accept (a reference fallback counted)
        and the value checks to run before it (None if none)."""
        decision = self.decision(decision_key)
        impl, rejections = select(decision, args)
        if impl.backend.name == REFERENCE and decision.vendor_available and rejections:
            dispatcher().fallback(self, decision_key, decision, rejections)
        return impl, _value_checks_before(decision, impl)

    def decision(self, decision_key: tuple) -> Decision:
        decision = self._decisions.get(decision_key)
        if decision is None:
            decision = dispatcher().decide(self, decision_key)
            first = decision.candidates[0]
            falls_back = (first.backend.name == REFERENCE and decision.vendor_available
                          and bool(decision.static_rejections))
            if first.supports is None and first.supports_metadata is None and not falls_back:
                fn = first.fn
                if decision.check_values is not None and not first.validates_values:
                    fn = _values_checked(decision.check_values, fn, self.params)
                self._direct[decision_key] = fn
            self._decisions[decision_key] = decision
        return decision

    def explain(self, *args: Any, **kwargs: Any) -> Explanation:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        args = tuple(bound.arguments.values())
        described = describe_args(args)
        try:
            key = self.check(*args)
            if self.check_values is not None:
                self.check_values(*args)
        except InvalidInputError as exc:
            return Explanation(self.name, described, (), None, (), False, str(exc))
        key = (key[0], key[1], _PIN.get(), *key[2:])
        decision = self.decision(key)
        impl, rejections = select(decision, args)
        fallback = impl.backend.name == REFERENCE and decision.vendor_available and bool(rejections)
        rows = tuple((f"{b.name}.{self.name}", r) for b, r in rejections)
        return Explanation(self.name, described, key, impl.qualname, rows, fallback,
                           decision.error if fallback else None)

    def clear(self) -> None:
        """Forget every decision (plugins or settings changed)."""
        self._direct.clear()
        self._decisions.clear()
        self._passed.clear()
        self._passed_out.clear()

    def __repr__(self) -> str:
        return f"<glm5_hal op {self.name}{self.signature}>"


def select(decision: Decision, args: tuple) -> tuple[Impl, list[tuple[Backend, str]]]:
    """The implementation a call gets, and every rejection on the way (static ones first)."""
    rejections = list(decision.static_rejections)
    for impl in decision.candidates:
        verdict: Any = True
        for predicate in (impl.supports_metadata, impl.supports):
            if predicate is not None and verdict is True:
                verdict = _verdict(predicate, args)
        if verdict is True:
            return impl, rejections
        rejections.append((impl.backend, verdict))
    raise AssertionError("the reference implementation is always the last candidate")


def _value_checks_before(decision: Decision, impl: Impl) -> Callable[..., None] | None:
    """The op's value checks where they run before `impl` (it does not validate values)."""
    return None if decision.check_values is None or impl.validates_values else decision.check_values


def _verdict(predicate: Callable, args: tuple) -> "bool | str":
    """A predicate's verdict on a call: True, or the reason it declines (raising declines)."""
    try:
        verdict = predicate(*args)
    except Exception as exc:
        return f"supports() raised {type(exc).__name__}: {exc}"
    if verdict is True or isinstance(verdict, str):
        return verdict
    return f"supports() returned {verdict!r}"


def signature_mismatch(op: Op, fn: Callable) -> str | None:
    """Why `fn` cannot implement `op` (None if it can): its parameters must start with the
    op's, by name and in order (dispatch passes every argument positionally, so their
    defaults do not matter; further parameters need defaults), or it is a plain `*args`
    forwarder."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    kinds = [p.kind for p in params]
    if kinds and kinds[0] == inspect.Parameter.VAR_POSITIONAL and all(
            k in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for k in kinds):
        return None
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    n = len(op.params)
    required_extra = [p.name for p in positional[n:] + [
        p for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY]
        if p.default is inspect.Parameter.empty]
    if [p.name for p in positional[:n]] != list(op.params) or required_extra:
        return (f"takes ({', '.join(p.name for p in params)}), the op takes ({', '.join(op.params)})")
    return None


# -- helpers ------------------------------------------------------------------------------------
_increment_version = torch._C._increment_version
_inference_mode = torch.is_inference_mode_enabled


def _refuse_overlap(op: Op, out: torch.Tensor, args: tuple) -> None:
    """InvalidInputError if `out`'s memory overlaps an input's (from its first element to its
    last, strides included): a kernel would read what it has already overwritten. Reads data
    pointers, sizes and strides only (no device sync); tensors without memory (meta) pass.
    Inline and flat: it runs on every call with a buffer."""
    start = out.data_ptr()
    if not start:
        return
    end = start + out.nbytes
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            first = a.data_ptr()
            # an input starting below out's end overlaps it if its last byte lies past out's start
            if first < end and first and (first + a.nbytes > start if a.is_contiguous() else
                                          _span_end(a, first) > start) and a.numel():
                _overlap_error(op, op.params[i], out, a)
        elif type(a) is tuple or type(a) is list:   # an FP8 pair
            for t in a:
                first = t.data_ptr()
                if first < end and first and _span_end(t, first) > start and t.numel():
                    _overlap_error(op, op.params[i], out, t)


def _span_end(t: torch.Tensor, first: int) -> int:
    """The address past `t`'s last element (its first at `first`; strides are non-negative)."""
    return first + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _overlap_error(op: Op, name: str, out: torch.Tensor, t: torch.Tensor) -> None:
    start, first = out.data_ptr(), t.data_ptr()
    raise InvalidInputError(op.name, "out", "memory not overlapping any input's",
                            f"bytes [{start:#x}, {start + out.nbytes:#x}) overlapping {name!r} at "
                            f"[{first:#x}, {_span_end(t, first):#x})")


def _key_without_pin(key: str) -> str:
    return key.replace(", _pin()", "")


def _with_default(p: inspect.Parameter) -> str:
    return p.name if p.default is inspect.Parameter.empty else f"{p.name}=_default_{p.name}"


def _values_checked(check_values: Callable[..., None], fn: Callable, params: Sequence[str]) -> Callable:
    """`fn` with the op's value checks in front, taking the op's parameters by name (no
    *args tuple on a path every call takes)."""
    names = ", ".join(params)
    ns: dict[str, Any] = {"_check_values": check_values, "_fn": fn}
    exec(f"def checked({names}):\n    _check_values({names})\n    return _fn({names})\n", ns)
    return ns["checked"]


def _infer_schema(name: str, reference: Callable, signature: inspect.Signature,
                  pairs: Sequence[str], mutates: Sequence[str]) -> str:
    """The torch schema of `reference`'s signature, without defaults (torch drops trailing
    arguments equal to their default before calling the kernel, so the kernel would see a
    short argument list) and with each `Fp8Pair` argument split into `<arg>, <arg>_scale`."""
    hints = typing.get_type_hints(reference)
    params = []
    for p in signature.parameters.values():
        annotation = torch.Tensor if p.name in pairs else hints.get(p.name, p.annotation)
        params.append(p.replace(default=inspect.Parameter.empty, annotation=annotation))
        if p.name in pairs:
            params.append(inspect.Parameter(key_scale_name(p.name), inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            annotation=typing.Optional[torch.Tensor]))
    returns = hints.get("return")
    stub = _stub(signature.replace(parameters=params,
                                   return_annotation=None if returns is type(None) else returns))
    try:
        return torch.library.infer_schema(stub, mutates_args=tuple(mutates))
    except Exception as exc:
        raise HalError(f"op {name}: cannot infer a torch schema from the reference: {exc}") from None


def _stub(signature: inspect.Signature) -> Callable:
    def stub(*args: Any) -> Any:
        raise AssertionError("schema prototype only")
    stub.__signature__ = signature
    return stub


def _autograd_function(op: Op, backward: Callable, setup_context: Callable,
                       jvp: Callable) -> type[torch.autograd.Function]:
    """The op's autograd.Function, which the custom op's Autograd kernel (`_autograd_kernel`)
    applies for every differentiated call (plain autograd, torch.func's grad / vjp / jvp and
    vmap over them, forward-mode AD, torch.compile, export), whether it came through the
    public function or torch.ops.glm5_hal.<op>. torch.library.register_autograd's generated
    Function would lack setup_context and jvp, which functorch needs. Backward and
    setup_context are the op's (`autograd`, else the reference's vector-Jacobian product),
    the forward-mode rule `jvp(inputs, tangents)` the op's or the reference's; the vmap rule is
    generated from the forward (the batched custom op)."""

    class Function(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*flat):
            with torch._C._AutoDispatchBelowAutograd():
                return op.torch_op(*flat)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs, output)
            ctx.jvp_is_tensor = [isinstance(a, torch.Tensor) for a in inputs]
            ctx.jvp_values = [None if t else a for t, a in zip(ctx.jvp_is_tensor, inputs)]
            ctx.save_for_forward(*[a for a in inputs if isinstance(a, torch.Tensor)])

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

        @staticmethod
        def jvp(ctx, *tangents):
            saved = iter(ctx.saved_tensors)
            inputs = [next(saved) if t else v for t, v in zip(ctx.jvp_is_tensor, ctx.jvp_values)]
            return jvp(tuple(inputs), tangents)

    Function.__name__ = Function.__qualname__ = f"{op.name}_autograd"
    return Function


#: set while the custom op's Autograd kernel differentiates at one functorch level, where no
#: functorch transform may start (`_reference_jvp`)
_AT_ONE_LEVEL: contextvars.ContextVar[bool] = contextvars.ContextVar("glm5_hal_at_one_level", default=False)


def _autograd_kernel(op: Op, function: type[torch.autograd.Function], jvp: Callable) -> Callable:
    """The torch custom op's Autograd kernel, so that `torch.ops.glm5_hal.<op>` itself works
    under autograd, forward-mode AD and torch.func's grad / vjp / jvp, as the public function
    does (torch.library.register_autograd generates a Function without setup_context and
    jvp, which functorch refuses).

    By the time this kernel runs under a functorch grad or jvp level, functorch has unwrapped
    that level's tensors, and the op differentiates at that one level, as torch's own
    derivative formulas do: under grad, the op's Function applied directly (its `apply` would
    hand it to functorch again); under jvp, the op on the primals and the forward-mode rule on
    the tangents (at forward-AD level 0, functorch's). Outside functorch: the Function when
    autograd records the call (grad enabled, an input requiring grad) or forward-mode AD is
    active, else the op below autograd."""
    from torch._functorch.utils import enable_single_level_autograd_function
    below_autograd = torch._C._AutoDispatchBelowAutograd
    any_requires_grad = torch._C._any_requires_grad
    single_level_apply = super(torch.autograd.Function, function).apply

    def autograd(*flat):
        transform = _innermost_transform()
        if transform == _GRAD or transform == _JVP:
            token = _AT_ONE_LEVEL.set(True)
            try:
                if transform == _JVP:
                    return _jvp_at_one_level(op, jvp, flat)
                with enable_single_level_autograd_function():
                    return single_level_apply(*flat)
            finally:
                _AT_ONE_LEVEL.reset(token)
        if (torch.is_grad_enabled() and any_requires_grad(*flat)) or _forward_ad._current_level >= 0:
            return function.apply(*flat)
        with below_autograd():
            return op.torch_op(*flat)
    return autograd


def _jvp_at_one_level(op: Op, jvp: Callable, flat: tuple) -> Any:
    """The op at a functorch jvp level, from inside its Autograd kernel: the op on the primals,
    each floating-point output dual with its tangent from `jvp(primals, tangents)`."""
    primals, tangents = [], []
    for a in flat:
        if isinstance(a, torch.Tensor):
            a, tangent = _forward_ad.unpack_dual(a, level=0)
        else:
            tangent = None
        primals.append(a)
        tangents.append(tangent)
    with torch._C._AutoDispatchBelowAutograd():
        out = op.torch_op(*primals)
    tangent_out = jvp(tuple(primals), tuple(tangents))
    if not isinstance(out, tuple):
        return _dual(out, tangent_out)
    return tuple(_dual(o, t) for o, t in zip(out, tangent_out))


def _dual(out: torch.Tensor, tangent: torch.Tensor | None) -> torch.Tensor:
    if tangent is None or not out.is_floating_point():
        return out
    return _forward_ad.make_dual(out, tangent, level=0)


def _looped_vmap(op: Op, written: list[int]) -> Callable:
    """The vmap rule of an op that writes arguments: the op on each example in turn (the
    written arguments must be batched, as for torch's own in-place ops)."""

    def rule(info, in_dims, *flat):
        for i in written:
            if in_dims[i] is None:
                raise InvalidInputError(
                    f"{op.name}: argument '{op.torch_params()[i]}': expected a batched tensor under "
                    f"vmap (it is written in place with batched inputs), got an unbatched one")
        for b in range(info.batch_size):
            op.torch_op(*[a if d is None else a.select(d, b) for a, d in zip(flat, in_dims)])
        return None, None
    return rule


def _functionalized(op: Op, written: list[int]) -> Callable:
    """An op that writes arguments under torch.func.functionalize (torch's functionalization
    fallback refuses custom ops that write their arguments; a Functionalize kernel would also
    take the place of torch.compile's auto_functionalize): the op writes fresh copies of them
    one level down, and the copies become the functional tensors' new values."""
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    def call(*flat):
        plain = []
        for a in flat:
            if isinstance(a, torch.Tensor) and torch._is_functional_tensor(a):
                torch._functionalize_sync(a)
                a = torch._from_functional_tensor(a)
            plain.append(a)
        for i in written:
            plain[i] = plain[i].clone()
        with retrieve_current_functorch_interpreter().lower():
            op.torch_op(*plain)
        for i in written:
            torch._functionalize_replace(flat[i], plain[i])
            torch._functionalize_commit_update(flat[i])
    return call


def _reference_jvp(op: Op) -> Callable:
    """A forward-mode rule for `op`: the Jacobian-vector product of its reference with respect
    to every floating-point tensor input that has a tangent."""

    def jvp(flat: tuple, tangents: tuple) -> Any:
        wanted = [i for i, (a, t) in enumerate(zip(flat, tangents)) if t is not None
                  and isinstance(a, torch.Tensor) and a.is_floating_point()]

        def reference(*primals):
            args = list(flat)
            for i, p in zip(wanted, primals):
                args[i] = p
            return op.reference(*op.from_torch(tuple(args)))
        primals, directions = tuple(flat[i] for i in wanted), tuple(tangents[i] for i in wanted)
        if _AT_ONE_LEVEL.get():   # inside the custom op's Autograd kernel (_autograd_kernel)
            out, tangent = _jvp_at_level_zero(reference, primals, directions)
        elif _functorch_levels():
            out, tangent = torch.func.jvp(reference, primals, directions)
        else:   # eager forward-mode AD, which does not nest: the transpose of the VJP
            out, tangent = _jvp_by_double_vjp(reference, primals, directions)
        if not isinstance(out, tuple):
            return tangent
        # an integer output (indices) is not differentiable: no tangent
        return tuple(t if o.is_floating_point() else None for o, t in zip(out, tangent))
    return jvp


def _jvp_at_level_zero(fn: Callable, primals: tuple, directions: tuple) -> tuple[Any, Any]:
    """fn(*primals) and its Jacobian-vector product along `directions`, by forward-mode AD at
    level 0, where the custom op's Autograd kernel runs under functorch's jvp."""
    out = fn(*[_forward_ad.make_dual(p, d, level=0) for p, d in zip(primals, directions)])
    outs = out if isinstance(out, tuple) else (out,)
    unpacked = [_forward_ad.unpack_dual(o, level=0) for o in outs]
    tangent = tuple(torch.zeros_like(p) if t is None and p.is_floating_point() else t for p, t in unpacked)
    primal = tuple(p for p, _ in unpacked)
    return (primal, tangent) if isinstance(out, tuple) else (primal[0], tangent[0])


def _jvp_by_double_vjp(fn: Callable, primals: tuple, directions: tuple) -> tuple[Any, Any]:
    """fn(*primals) and its Jacobian-vector product along `directions`, by reverse mode only:
    the VJP u -> J^T u is linear in u, and its VJP along the directions is J t."""
    with torch.enable_grad():
        xs = [p.detach().requires_grad_() for p in primals]
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        diff = [k for k, o in enumerate(outs) if o.is_floating_point() and o.requires_grad]
        us = [torch.zeros_like(outs[k], requires_grad=True) for k in diff]
        grads = torch.autograd.grad([outs[k] for k in diff], xs, us, create_graph=True, allow_unused=True)
        used = [(g, d) for g, d in zip(grads, directions) if g is not None]
        jt = (torch.autograd.grad([g for g, _ in used], us, [d for _, d in used], allow_unused=True)
              if used else [None] * len(us))
    tangent: list[Any] = [None] * len(outs)
    for k, t in zip(diff, jt):
        tangent[k] = torch.zeros_like(outs[k]) if t is None else t.detach()
    out = tuple(o.detach() for o in outs) if isinstance(out, tuple) else outs[0].detach()
    return out, (tuple(tangent) if isinstance(out, tuple) else tangent[0])


def _reference_vjp(op: Op) -> tuple[Callable, Callable]:
    """A backward for `op` that recomputes its reference under autograd and returns the
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
        if _functorch_levels():   # inside torch.func.grad / vjp: requires_grad_ is not allowed
            return _functorch_vjp(op, flat, wanted, grads, result)
        with torch.enable_grad():
            for i in wanted:
                flat[i] = flat[i].detach().requires_grad_()
            out = op.reference(*op.from_torch(tuple(flat)))
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


def _functorch_vjp(op: Op, flat: list, wanted: list[int], grads: tuple, result: list) -> tuple:
    """`_reference_vjp`'s backward through torch.func.vjp (under a functorch transform)."""
    keep = [j for j, g in enumerate(grads) if isinstance(g, torch.Tensor) and g.is_floating_point()]
    if not keep:
        return tuple(result)

    def reference(*primals):
        args = list(flat)
        for i, p in zip(wanted, primals):
            args[i] = p
        out = op.reference(*op.from_torch(tuple(args)))
        outs = out if isinstance(out, tuple) else (out,)
        return tuple(outs[j] for j in keep)

    _, pullback = torch.func.vjp(reference, *[flat[i] for i in wanted])
    for i, g in zip(wanted, pullback(tuple(grads[j] for j in keep))):
        result[i] = g
    return tuple(result)
