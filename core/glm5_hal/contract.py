"""An op's input contract, declared once and compiled into one straight-line check.

Each op declares its arguments (`Tensor`, `Fp8Pair`, `Int`, `Number`, `Bool`, `Choice`,
`DType`) and the relations between them (`Rule`); `compile_contract` turns that
declaration into the source of a function with the op's parameters that raises
`InvalidInputError` (op, argument, expected, actual) on the first violation and binds the
dispatch argument's device and dtype. The generated code is what every call pays for, so it
is flat: no helper calls, one read of each tensor's shape, dtype and device.

Shapes are written as comma-separated dims, outermost first:

    "T, H, R"        three dims; a name seen for the first time binds that dim,
                     a name seen before (here or in an earlier argument) must match it
    "..., D"         any number of leading dims (at least the listed ones)
    "*, 16"          `*` accepts any size; an integer or an expression over bound names
                     ("K // 128", "ceil_div(N, 128)", "K // group_size") must match

Rules and shape expressions may call the helpers in `HELPERS` (`is_power_of_two`, `ceil_div`).

An op that takes a caller's output buffer declares it with `Out` (the `out=` keyword of its
public function): the result's shape over dims the inputs bound, and its dtype. It compiles
into `Compiled.out_lines`, checked after the inputs.

Everything here only reads metadata, so the same check runs on fake tensors while tracing;
data-dependent checks (index ranges) are the op's value checks (glm5_hal.checks).
"""
from __future__ import annotations

import ast
import dataclasses
import math
from typing import Any, Sequence

import torch

from .checks import FP8, dtype_list, is_paged
from .errors import HalError, InvalidInputError

_DIM_PREFIX = "_d_"


def is_power_of_two(n) -> bool:
    # plain arithmetic (no bit tricks) so that it also works on symbolic sizes while tracing
    if n < 1:
        return False
    while n % 2 == 0:
        n = n // 2
    return n == 1


def ceil_div(a, b):
    return -(-a // b)


#: functions rules and shape expressions may call
HELPERS = {"is_power_of_two": is_power_of_two, "ceil_div": ceil_div}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor argument.

    shape: see the module docstring.
    dtypes: the accepted dtypes, or the name of an earlier argument whose dtype it must have.
    optional: None is accepted (nothing else is checked then).
    contiguous: the tensor must be contiguous (in-place targets the kernels index flat).
    paged: the tensor is a paged cache written in place (glm5_hal.checks.is_paged: each block
        row-major contiguous, blocks apart; a serving engine's block-strided page views pass).
        The call key carries whether the layout is paged (glm5_hal._C.call_key's code 'g').
    layout: name the dims in a shape mismatch ("shape [T, topk] = [3, *]") instead of
        showing the resolved sizes only ("shape [3, *]").
    """
    shape: str
    dtypes: Sequence[torch.dtype] | str | None = None
    optional: bool = False
    contiguous: bool = False
    layout: bool = False
    paged: bool = False


@dataclasses.dataclass(frozen=True)
class Fp8Pair:
    """Indexer keys: a float tensor of `like`'s dtype, or an FP8 pair (values
    float8_e4m3fn of `shape`, float32 scale of `shape` without its last dim). The torch
    schema splits the pair into two arguments, the second named `<arg>_scale`. The last
    dim must be bound by an earlier argument (the head dim)."""
    shape: str
    like: str


@dataclasses.dataclass(frozen=True)
class Int:
    min: int | None = None


@dataclasses.dataclass(frozen=True)
class Number:
    """A finite int or float; `min` inclusive, `gt` exclusive."""
    min: float | None = None
    gt: float | None = None


@dataclasses.dataclass(frozen=True)
class Bool:
    pass


@dataclasses.dataclass(frozen=True)
class Choice:
    options: tuple


@dataclasses.dataclass(frozen=True)
class DType:
    """A torch.dtype argument (e.g. an output dtype) from `options`."""
    options: tuple


@dataclasses.dataclass(frozen=True)
class Unchecked:
    """An argument the contract does not check at all (it is passed on as given). The
    conformance suite's own tests define copies of ops with unchecked arguments to prove that
    its expected-error cases fail on an op that skips validation."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """A relation the shapes and scalars must satisfy, checked as soon as every name in
    `condition` is known. A failure names `arg` with `expected` (a str.format template
    over the same names) and the argument's shape (tensors) or value (scalars)."""
    arg: str
    condition: str
    expected: str


@dataclasses.dataclass(frozen=True)
class Let:
    """A derived dim, `name = expression`, bound as soon as the expression's names are
    (e.g. Let("K", "W * 8"): the unpacked width of a packed weight)."""
    name: str
    expression: str


@dataclasses.dataclass(frozen=True)
class Out:
    """The caller-provided output buffer an op may take as `out=` (glm5_hal.opdef.define): a
    dense, contiguous tensor of exactly the result's shape and dtype on the dispatch device.
    For an op that returns a tuple it is the first result's buffer.

    shape: dims written over names the inputs bound, and scalar arguments ("B, N, H, d_v",
        "..., N2 // 2"); no new names: a buffer is never resized, so every dim is known
        before the call. A leading "..." stands for the leading dims of the one input whose
        shape starts with "...".
    dtype: the name of a tensor argument (its dtype), of a DType argument (its value), or a
        torch.dtype.
    """
    shape: str
    dtype: str | torch.dtype


ArgSpec = Tensor | Fp8Pair | Int | Number | Bool | Choice | DType | Unchecked

#: call_key plan codes of a Tensor argument by (contiguous, optional)
_TENSOR_CODES = {(False, False): "t", (True, False): "c", (False, True): "o", (True, True): "p"}


def key_scale_name(arg: str) -> str:
    """The torch-schema name of an FP8 key pair's scale argument."""
    return f"{arg}_scale"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """The generated check: `lines` (the body, indented for a function of the op's
    parameters), the names it needs bound in its namespace, and the local names it leaves
    for the caller: the dispatch argument's device and dtype, and one bool per Fp8Pair
    argument (True for an FP8 pair).

    `plan` says what the check reads from each parameter, for glm5_hal._C.call_key (one
    byte each: "t" a tensor, "c" one whose contiguity is read, "o"/"p" the same optional,
    "k" a key, "s" a scalar), or None when the check reads something call_key does not
    (an Unchecked argument): two calls with equal call keys pass or fail the check alike.

    `out_lines` check the `out` buffer (an `Out` spec) against the bound dims; they run after
    `lines`, in the same function, with `out` a parameter after the op's (empty: no `Out`)."""
    lines: tuple[str, ...]
    namespace: dict[str, Any]
    device: str
    dtype: str
    pair_flags: tuple[str, ...]
    plan: bytes | None
    out_lines: tuple[str, ...] = ()


def compile_contract(op: str, params: Sequence[str], args: dict[str, ArgSpec],
                     rules: Sequence[Rule | Let] = (), out: Out | None = None) -> Compiled:
    """Compiles the declaration of `op` into a check. `args` declares every parameter, in
    the order they are checked (a shape may use a scalar declared before it); the first
    declared tensor is the first tensor parameter, whose device and dtype key dispatch.
    `out`: the op's output buffer, if it takes one (`Compiled.out_lines`)."""
    if out is not None and "out" in params:
        raise HalError(f"op {op}: a parameter named 'out' clashes with the out= buffer")
    unknown = set(args) - set(params)
    if unknown:
        raise HalError(f"op {op}: contract declares unknown arguments {sorted(unknown)}")
    missing = [p for p in params if p not in args]
    if missing:
        raise HalError(f"op {op}: contract does not declare {missing}")
    return _Compiler(op, list(params), args, list(rules)).run(out)


class _Compiler:
    def __init__(self, op: str, params: list[str], args: dict[str, ArgSpec], rules: list[Rule]):
        self.op, self.params, self.args = op, params, args
        self.rules = [(rule, _names(rule.expression if isinstance(rule, Let) else rule.condition, op))
                      for rule in rules]
        self.lines: list[str] = []
        self.ns: dict[str, Any] = {"_Tensor": torch.Tensor, "_SymInt": torch.SymInt, "_is_paged": is_paged,
                                   "_isfinite": math.isfinite, "_fail": self._failer(),
                                   "_dtname": _dtype_name, **HELPERS}
        self.bound: set[str] = set()      # dim names and checked scalars known so far
        self.tensors: dict[str, str] = {}  # argument -> local holding its dtype
        self.device: str | None = None
        tensors = [p for p in args if isinstance(args[p], (Tensor, Fp8Pair))
                   or (isinstance(args[p], Unchecked) and p == params[0])]
        if not tensors or tensors[0] != next(p for p in params if p in tensors):
            raise HalError(f"op {op}: the first declared tensor argument must be the first tensor "
                           f"parameter (it keys dispatch); declared {list(args)}, parameters {params}")
        self.dispatch = tensors[0]
        self.pairs: list[str] = []
        self.constants = 0
        self.leading: list[tuple[str, int]] = []   # (tensor, its listed dims) for "..., ..." shapes

    def _failer(self):
        op = self.op

        def fail(arg, expected, actual):
            raise InvalidInputError(op, arg, expected, actual)
        return fail

    def const(self, value: Any) -> str:
        name = f"_c{self.constants}"
        self.constants += 1
        self.ns[name] = value
        return name

    def emit(self, line: str, depth: int) -> None:
        self.lines.append("    " * depth + line)

    def run(self, out: Out | None = None) -> Compiled:
        for name in self.args:  # in declaration order: a shape may use a scalar declared before it
            spec = self.args[name]
            if isinstance(spec, Unchecked):
                if name == self.dispatch:   # the key still needs a device and a dtype
                    self.emit(f"_dev, _dt_{name} = {name}.device, {name}.dtype", 0)
                    self.device, self.tensors[name] = name, f"_dt_{name}"
            elif isinstance(spec, Fp8Pair):
                self.fp8_pair(name, spec)
            elif isinstance(spec, Tensor):
                self.tensor(name, spec)
            else:
                self.scalar(name, spec)
            self.flush_rules(0)
        pending = [r.expression if isinstance(r, Let) else r.condition for r, _ in self.rules]
        if pending:
            raise HalError(f"op {self.op}: rules name unknown dims or arguments: {pending}")
        lines = tuple(self.lines)
        self.lines = []
        if out is not None:
            self.out(out)
        return Compiled(lines, self.ns, "_dev", f"_dt_{self.dispatch}",
                        tuple(f"_pair_{p}" for p in self.pairs), self.plan(), tuple(self.lines))

    def plan(self) -> bytes | None:
        codes = []
        for name in self.params:
            spec = self.args[name]
            if isinstance(spec, Unchecked):
                return None
            if isinstance(spec, Fp8Pair):
                codes.append("k")
            elif isinstance(spec, Tensor):
                codes.append("g" if spec.paged else _TENSOR_CODES[spec.contiguous, spec.optional])
            else:
                codes.append("s")
        return "".join(codes).encode()

    # -- rules ---------------------------------------------------------------------------
    def flush_rules(self, depth: int) -> None:
        while True:
            ready = [(r, n) for r, n in self.rules if n <= self.bound]
            if not ready:
                return
            self.rules = [(r, n) for r, n in self.rules if not n <= self.bound]
            self.emit_rules(ready, depth)

    def emit_rules(self, ready: list, depth: int) -> None:
        for rule, names in ready:
            if isinstance(rule, Let):
                self.emit(f"{_DIM_PREFIX}{rule.name} = {_rename(rule.expression, self.params)}", depth)
                self.bound.add(rule.name)
                continue
            cond = _rename(rule.condition, self.params)
            values = "{" + ", ".join(f"{n!r}: {_local(n, self.params)}" for n in sorted(names)) + "}"
            template = self.const(rule.expected)
            actual = (f"'shape %s' % list(_s_{rule.arg})" if rule.arg in self.tensors
                      else rule.arg)
            self.emit(f"if not ({cond}):", depth)
            self.emit(f"_fail({rule.arg!r}, {template}.format(**{values}), {actual})", depth + 1)

    # -- tensors -------------------------------------------------------------------------
    def tensor(self, name: str, spec: Tensor, depth: int = 0, local: str | None = None) -> None:
        var = local or name
        bound_before = set(self.bound)
        if spec.optional:
            self.emit(f"if {var} is not None:", depth)
            depth += 1
        self.type_and_rank(name, var, spec.shape, depth)
        self.dtype(name, var, spec.dtypes, depth)
        self.device_of(name, var, depth)
        dims = _split(spec.shape)
        if dims and dims[0] == "..." and not spec.optional:
            self.leading.append((name, len(dims) - 1))
        if spec.contiguous:
            # the class's method: an attribute set on the tensor must not answer for it
            self.emit(f"if not _Tensor.is_contiguous({var}):", depth)
            self.emit(f"_fail({name!r}, 'a contiguous tensor', 'strides %s for shape %s' "
                      f"% (list({var}.stride()), list(_s_{name})))", depth + 1)
        if spec.paged:
            self.emit(f"if not _is_paged({var}):", depth)
            self.emit(f"_fail({name!r}, 'a paged layout (each block row-major contiguous, blocks not "
                      f"overlapping)', 'strides %s for shape %s' % (list({var}.stride()), list(_s_{name})))",
                      depth + 1)
        self.dims(name, spec.shape, depth, spec.layout)
        if spec.optional and self.bound - bound_before:
            raise HalError(f"op {self.op}: optional {name} may only use dims bound earlier")

    def type_and_rank(self, name: str, var: str, shape: str, depth: int) -> None:
        dims = _split(shape)
        self.emit(f"if type({var}) is not _Tensor and not isinstance({var}, _Tensor):", depth)
        self.emit(f"_fail({name!r}, 'a torch.Tensor', type({var}).__name__)", depth + 1)
        self.emit(f"_s_{name} = {var}.shape", depth)
        if dims and dims[0] == "...":
            n = len(dims) - 1
            self.emit(f"if len(_s_{name}) < {n}:", depth)
            self.emit(f"_fail({name!r}, 'at least {n} dims', 'shape %s' % list(_s_{name}))", depth + 1)
        else:
            self.emit(f"if len(_s_{name}) != {len(dims)}:", depth)
            self.emit(f"_fail({name!r}, 'a {len(dims)}-d tensor', 'shape %s' % list(_s_{name}))", depth + 1)

    def dtype(self, name: str, var: str, dtypes, depth: int) -> None:
        self.emit(f"_dt_{name} = {var}.dtype", depth)
        self.tensors[name] = f"_dt_{name}"
        if dtypes is None:
            return
        if isinstance(dtypes, str):
            other = self.tensors.get(dtypes)
            if other is None:
                raise HalError(f"op {self.op}: {name} takes the dtype of {dtypes!r}, "
                               "which is not an earlier tensor argument")
            text = self.const(f"dtype {{}} (the dtype of {dtypes!r})")
            self.emit(f"if _dt_{name} is not {other}:", depth)
            self.emit(f"_fail({name!r}, {text}.format(_dtname({other})), _dtname(_dt_{name}))", depth + 1)
            return
        allowed = self.const(frozenset(dtypes))
        text = self.const(f"dtype {dtype_list(dtypes)}")
        self.emit(f"if _dt_{name} not in {allowed}:", depth)
        self.emit(f"_fail({name!r}, {text}, _dtname(_dt_{name}))", depth + 1)

    def device_of(self, name: str, var: str, depth: int) -> None:
        if self.device is None:
            if depth:
                raise HalError(f"op {self.op}: the first tensor argument {name} cannot be optional")
            self.device = name
            self.emit(f"_dev = {var}.device", depth)
            return
        text = self.const(f"a tensor on {{}} (the device of {self.device!r})")
        self.emit(f"if {var}.device != _dev:", depth)
        self.emit(f"_fail({name!r}, {text}.format(_dev), 'device %s' % ({var}.device,))", depth + 1)

    def dims(self, name: str, shape: str, depth: int, layout: bool) -> None:
        dims = _split(shape)
        lead = dims[0] == "..."
        if lead:
            dims = dims[1:]
        offset = -len(dims) if lead else 0
        checks: list[tuple[int, str]] = []
        binds: list[tuple[int, str]] = []
        shown: list[str] = []
        for i, dim in enumerate(dims):
            index = i + offset
            if dim == "*":
                shown.append("*")
            elif dim.isidentifier() and dim not in self.bound and dim not in self.params:
                binds.append((index, dim))
                shown.append("*")
            else:
                missing = _names(dim, self.op) - self.bound
                if missing:
                    raise HalError(f"op {self.op}: {name} shape {shape!r} uses {sorted(missing)} "
                                   "before they are bound")
                expr = _rename(dim, self.params)
                checks.append((index, expr))
                shown.append("{}")
        if checks:
            cond = " or ".join(f"_s_{name}[{i}] != {expr}" for i, expr in checks)
            resolved = ", ".join((["..."] if lead else []) + shown)
            names = ", ".join((["..."] if lead else []) + dims)
            template = self.const(f"shape [{names}] = [{resolved}]" if layout else f"shape [{resolved}]")
            values = ", ".join(expr for _, expr in checks)
            self.emit(f"if {cond}:", depth)
            self.emit(f"_fail({name!r}, {template}.format({values}), 'shape %s' % list(_s_{name}))", depth + 1)
        for index, dim in binds:
            self.emit(f"{_DIM_PREFIX}{dim} = _s_{name}[{index}]", depth)
            self.bound.add(dim)

    # -- the out= buffer ------------------------------------------------------------------
    def out(self, spec: Out) -> None:
        """Lines checking `out` against `spec`, after the inputs: every dim is bound by then."""
        dims = _split(spec.shape)
        lead = bool(dims) and dims[0] == "..."
        if lead:
            dims = dims[1:]
            if len(self.leading) != 1:
                raise HalError(f"op {self.op}: out shape {spec.shape!r} starts with '...', which needs "
                               f"exactly one input shaped '..., ...'; found {[n for n, _ in self.leading]}")
        for dim in dims:
            missing = _names(dim, self.op) - self.bound
            if dim == "*" or missing:
                raise HalError(f"op {self.op}: out shape {spec.shape!r}: every dim must be written over "
                               f"names the inputs bind (a buffer is never resized); unbound: "
                               f"{sorted(missing) if missing else ['*']}")
        exprs = [_rename(d, self.params) for d in dims]
        if lead:
            source, listed = self.leading[0]
            exprs.insert(0, f"*_s_{source}[:len(_s_{source}) - {listed}]")
            names = f"[..., {', '.join(dims)}] (... the leading dims of {source!r})"
        else:
            names = f"[{', '.join(dims)}]"
        expected = f"({', '.join(exprs)}{',' if len(exprs) == 1 else ''})"
        self.ns["_strided"] = torch.strided
        self.emit("if type(out) is not _Tensor and not isinstance(out, _Tensor):", 0)
        self.emit("_fail('out', 'a torch.Tensor or None', type(out).__name__)", 1)
        self.emit("if out.layout is not _strided:", 0)
        self.emit("_fail('out', 'a dense (strided) tensor', 'layout %s' % (out.layout,))", 1)
        self.emit("_dt_out = out.dtype", 0)
        if isinstance(spec.dtype, torch.dtype):
            wanted, why = self.const(spec.dtype), ""
        elif spec.dtype in self.tensors:
            wanted, why = self.tensors[spec.dtype], f" (the dtype of {spec.dtype!r})"
        elif isinstance(self.args.get(spec.dtype), DType):
            wanted, why = spec.dtype, f" ({spec.dtype})"
        else:
            raise HalError(f"op {self.op}: out dtype {spec.dtype!r} is neither a torch.dtype, a tensor "
                           "argument nor a DType argument")
        text = self.const(f"dtype {{}}{why} (the result's; out= never converts)")
        self.emit(f"if _dt_out is not {wanted}:", 0)
        self.emit(f"_fail('out', {text}.format(_dtname({wanted})), _dtname(_dt_out))", 1)
        self.device_of("out", "out", 0)
        self.emit("_s_out = out.shape", 0)
        self.emit(f"_e_out = {expected}", 0)
        template = self.const(f"shape {names} = {{}} (the result's; out= never resizes)")
        self.emit("if _s_out != _e_out:", 0)
        self.emit(f"_fail('out', {template}.format(list(_e_out)), 'shape %s' % list(_s_out))", 1)
        self.emit("if not _Tensor.is_contiguous(out):", 0)
        self.emit("_fail('out', 'a contiguous tensor', 'strides %s for shape %s' "
                  "% (list(out.stride()), list(_s_out)))", 1)

    # -- keys ----------------------------------------------------------------------------
    def fp8_pair(self, name: str, spec: Fp8Pair) -> None:
        dims = _split(spec.shape)
        last = dims[-1]
        if last not in self.bound:
            raise HalError(f"op {self.op}: key {name}'s last dim {last!r} must be bound earlier")
        if spec.like not in self.tensors:
            raise HalError(f"op {self.op}: key {name} is like {spec.like!r}, not an earlier tensor")
        self.pairs.append(name)
        scale = key_scale_name(name)
        layout = "[" + ", ".join(dims) + "]"
        rank = len(dims)
        like_dt = self.tensors[spec.like]
        bound_before = set(self.bound)
        self.emit(f"if type({name}) is tuple or type({name}) is list:", 0)
        self.emit(f"if len({name}) != 2:", 1)
        self.emit(f"_fail({name!r}, 'a tensor or a pair (fp8 values, float32 scale)', "
                  f"'a %s of length %d' % (type({name}).__name__, len({name})))", 2)
        self.emit(f"_kv_{name}, _ks_{name} = {name}", 1)
        self.emit(f"_pair_{name} = True", 1)
        self.type_and_rank(name, f"_kv_{name}", spec.shape, 1)
        self.dtype(name, f"_kv_{name}", (FP8,), 1)
        self.type_and_rank(scale, f"_ks_{name}", ", ".join(dims[:-1]), 1)
        self.dtype(scale, f"_ks_{name}", (torch.float32,), 1)
        self.emit(f"if _s_{scale} != _s_{name}[:-1]:", 1)
        self.emit(f"_fail({scale!r}, 'shape %s' % list(_s_{name}[:-1]), 'shape %s' % list(_s_{scale}))", 2)
        self.device_of(name, f"_kv_{name}", 1)
        self.device_of(scale, f"_ks_{name}", 1)
        self.key_last_dim(name, last, spec.like, 1)
        self.bind_leading(name, dims, 1)
        self.bound = set(bound_before)
        self.emit("else:", 0)
        self.emit(f"_pair_{name} = False", 1)
        self.type_and_rank(name, name, spec.shape, 1)
        self.emit(f"if {name}.dtype is _FP8:", 1)
        self.ns["_FP8"] = FP8
        text = self.const(f"a float tensor {layout}, or FP8 keys as a pair "
                          f"(float8_e4m3fn {layout}, float32 scale)")
        self.emit(f"_fail({name!r}, {text}, 'a bare float8_e4m3fn tensor')", 2)
        self.dtype(name, name, spec.like, 1)
        self.device_of(name, name, 1)
        self.key_last_dim(name, last, spec.like, 1)
        self.bind_leading(name, dims, 1)
        self.tensors[name] = like_dt

    def key_last_dim(self, name: str, last: str, like: str, depth: int) -> None:
        text = self.const(f"last dim {{}} ({last}, the last dim of {like!r})")
        self.emit(f"if _s_{name}[-1] != {_DIM_PREFIX}{last}:", depth)
        self.emit(f"_fail({name!r}, {text}.format({_DIM_PREFIX}{last}), 'shape %s' % list(_s_{name}))",
                  depth + 1)

    def bind_leading(self, name: str, dims: list[str], depth: int) -> None:
        for i, dim in enumerate(dims[:-1]):
            if dim == "*":
                continue
            if dim in self.bound:
                raise HalError(f"op {self.op}: key {name}'s leading dims must be new names")
            self.emit(f"{_DIM_PREFIX}{dim} = _s_{name}[{i}]", depth)
            self.bound.add(dim)

    # -- scalars -------------------------------------------------------------------------
    def scalar(self, name: str, spec: ArgSpec) -> None:
        if isinstance(spec, Int):
            self.emit(f"if type({name}) is not int and (isinstance({name}, bool) or "
                      f"not isinstance({name}, (int, _SymInt))):", 0)
            self.emit(f"_fail({name!r}, 'an int', repr({name}))", 1)
            if spec.min is not None:
                self.emit(f"if {name} < {spec.min}:", 0)
                self.emit(f"_fail({name!r}, 'an int >= {spec.min}', {name})", 1)
        elif isinstance(spec, Number):
            self.emit(f"if type({name}) is not float and (isinstance({name}, bool) or "
                      f"not isinstance({name}, (int, float))) or not _isfinite({name}):", 0)
            bound = f" > {spec.gt!r}" if spec.gt is not None else f" >= {spec.min!r}" if spec.min is not None else ""
            self.emit(f"_fail({name!r}, 'a finite number{bound}', repr({name}))", 1)
            if spec.min is not None:
                self.emit(f"if {name} < {spec.min!r}:", 0)
                self.emit(f"_fail({name!r}, 'a number >= {spec.min!r}', {name})", 1)
            if spec.gt is not None:
                self.emit(f"if {name} <= {spec.gt!r}:", 0)
                self.emit(f"_fail({name!r}, 'a number > {spec.gt!r}', {name})", 1)
        elif isinstance(spec, Bool):
            self.emit(f"if type({name}) is not bool:", 0)
            self.emit(f"_fail({name!r}, 'a bool', repr({name}))", 1)
        elif isinstance(spec, (Choice, DType)):
            options = self.const(frozenset(spec.options))
            shown = ([_dtype_name(o) for o in spec.options] if isinstance(spec, DType)
                     else list(spec.options))
            text = self.const(f"one of {shown}")
            self.emit(f"if {name} not in {options}:", 0)
            self.emit(f"_fail({name!r}, {text}, repr({name}))", 1)
        else:
            raise HalError(f"op {self.op}: argument {name} has an unknown spec {spec!r}")
        self.bound.add(name)


# -- small helpers ----------------------------------------------------------------------------
def _split(shape: str) -> list[str]:
    """The dims of a shape string, split at top-level commas (not inside calls)."""
    dims, depth, current = [], 0, ""
    for ch in shape:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            dims.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        dims.append(current.strip())
    return dims


def _names(expression: str, op: str) -> set[str]:
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise HalError(f"op {op}: cannot parse {expression!r}: {exc}") from None
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - set(HELPERS)


class _Renamer(ast.NodeTransformer):
    def __init__(self, params: Sequence[str]):
        self.params = set(params)

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.params or node.id in HELPERS:
            return node
        return ast.copy_location(ast.Name(_DIM_PREFIX + node.id, node.ctx), node)


def _rename(expression: str, params: Sequence[str]) -> str:
    """`expression` with dim names turned into their generated locals (scalar arguments,
    which are locals already, keep their names)."""
    tree = ast.parse(expression, mode="eval")
    return ast.unparse(_Renamer(params).visit(tree))


def _local(name: str, params: Sequence[str]) -> str:
    return name if name in params else _DIM_PREFIX + name


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")
