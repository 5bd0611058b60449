"""The Backend base class: what a backend is, what it can do, and how it declares kernels.

A backend is deliberately small: a name, the torch device type its kernels accept, a
priority, a cheap `probe()`, optional `capabilities()` and `versions()`, and a table of
op implementations filled with the `impl` decorator. Everything else has a safe default.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, Callable, Iterable, Mapping

import torch

#: `supports(*args)` returns True, or a string saying why the call is declined.
SupportsFn = Callable[..., "bool | str"]

ANY_DEVICE = "*"
#: the name of the backend serving every op's reference implementation (glm5_hal.backends.reference)
REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class Availability:
    """The result of `Backend.probe()`: usable or not, and why (always a specific reason)."""
    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a usable backend's device can do.

    dtypes: activation/storage dtypes the device supports at all; an implementation is
        never chosen for a dtype outside this set (the decision says so).
    dist_backend: the torch.distributed backend name for this device ("hccl", "gloo", ...).
    device_name: human-readable device/chip name, e.g. "Ascend910B2".
    limits: free-form facts for reports (op constraints, generation features).
    """
    dtypes: frozenset = frozenset({torch.float32, torch.float16, torch.bfloat16})
    dist_backend: str | None = None
    device_name: str = ""
    limits: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One backend's implementation of one op."""
    op: str
    backend: "Backend"
    fn: Callable
    dtypes: frozenset | None  # None: any dtype the op accepts
    supports: SupportsFn | None  # None: every call with an accepted dtype; runs per call
    validates_values: bool = False  # the kernel itself raises what the op's check_values would
    # a metadata-only predicate: evaluated once per call key (glm5_hal.opdef), its verdict
    # remembered with the chosen implementation
    supports_metadata: SupportsFn | None = None
    # `fn` takes a keyword-only `out=` buffer and writes its (first) result there, for an op
    # declared with one (glm5_hal.contract.Out); detected from fn's signature at registration
    takes_out: bool = False

    @property
    def needs_per_call_check(self) -> bool:
        """Whether every call must run a predicate of this implementation (`supports`)."""
        return self.supports is not None

    @property
    def qualname(self) -> str:
        return f"{self.backend.name}.{self.op}"


class Backend:
    """Base class of every backend. Subclass it, set `name`, `device_type`, `priority`,
    override `probe()`, and declare kernels with `@backend.impl(op, dtypes=..., supports=...)`.
    """
    name: str = ""
    device_type: str = ""
    priority: int = 0

    def __init__(self) -> None:
        self._impls: dict[str, Impl] = {}
        self._impls_view = types.MappingProxyType(self._impls)
        # Per-instance copies so that declaring kernels never touches the class.
        self._availability: Availability | None = None
        self._capabilities: Capabilities | None = None

    # -- overridable ----------------------------------------------------------------
    def probe(self) -> Availability:
        """Cheap check whether this backend can run here. Must never raise and never
        take the process down; the default says available."""
        return Availability(True, "no probe defined")

    def capabilities(self) -> Capabilities:
        """The device's capabilities; asked only after a successful probe."""
        return Capabilities()

    def versions(self) -> dict[str, str]:
        """Versions of the runtime pieces this backend uses (bridge, SDK, driver)."""
        return {}

    # -- declaring kernels -----------------------------------------------------------
    def impl(self, op: str, dtypes: Iterable[torch.dtype] | None = None,
             supports: SupportsFn | None = None, validates_values: bool = False,
             supports_metadata: SupportsFn | None = None) -> Callable[[Callable], Callable]:
        """Decorator declaring `fn` as this backend's implementation of `op`.

        dtypes: the dtypes of the op's dispatch argument this kernel accepts (None: all).
        The function takes exactly the op's parameters, by name and in order (as the op's
        reference in glm5_hal.reference does); registration refuses anything else. For an op
        with an `out=` buffer (glm5_hal.contract.Out) it may also take a keyword-only
        `out=None`: a call with a buffer then passes it, already checked (shape, dtype,
        device, contiguous, not overlapping an input), and the function writes its (first)
        result there instead of allocating one; without it dispatch copies the result in.
        supports_metadata: optional predicate `supports_metadata(*args) -> True | reason` that
            reads only what a call key holds: each tensor's dtype, device and sizes (its
            contiguity only where the op's contract requires it), the scalars, and the
            backend's own state (fixed until glm5_hal.reload()); not values, strides,
            addresses or process-wide settings that change between calls (a TF32 switch:
            those belong in `supports`). It runs once per call key; its
            verdict is remembered with the implementation chosen, so a vendor kernel costs per
            call what a predicate-free one does.
        supports: optional per-call predicate `supports(*args) -> True | reason`, for what
            `supports_metadata` may not read (values, strides, addresses); it runs on every
            call that reaches this implementation (after `supports_metadata`), so keep it
            cheap, and rare.
        validates_values: the kernel itself checks everything the op's data-dependent
            `check_values` checks (index ranges, repeated slots) and raises InvalidInputError
            naming the op and argument before writing anything. Dispatch then skips the
            op's value checks on calls that go straight to this kernel (on CPU tensors a
            native scan, about a microsecond per call on small inputs; on other devices torch
            ops that read device data, which dispatch runs only under GLM5_HAL_CHECKS=full).
        """
        def register(fn: Callable) -> Callable:
            if op in self._impls:
                from .errors import PluginError
                raise PluginError(f"backend {self.name!r}: op {op!r} implemented twice")
            self._impls[op] = Impl(op, self, fn,
                                   None if dtypes is None else frozenset(dtypes), supports,
                                   validates_values, supports_metadata, takes_out(fn))
            return fn
        return register

    # -- used by the registry --------------------------------------------------------
    @property
    def impls(self) -> Mapping[str, Impl]:
        """op name -> Impl, read-only."""
        return self._impls_view

    def availability(self) -> Availability:
        """The probe's answer, computed once (a probe that raises counts as unavailable)."""
        if self._availability is None:
            try:
                result = self.probe()
                if not isinstance(result, Availability):
                    result = Availability(False, f"probe() returned {type(result).__name__}, "
                                                 "expected glm5_hal.Availability")
            except BaseException as exc:  # a probe must never take the HAL down
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                result = Availability(False, f"probe raised {type(exc).__name__}: {exc}")
            self._availability = result
        return self._availability

    def cached_capabilities(self) -> Capabilities:
        if self._capabilities is None:
            try:
                self._capabilities = self.capabilities()
            except Exception as exc:  # capabilities are reported, never fatal
                self._capabilities = Capabilities(limits={"error": f"{type(exc).__name__}: {exc}"})
        return self._capabilities

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} device_type={self.device_type!r} priority={self.priority}>"


def takes_out(fn: Callable) -> bool:
    """Whether `fn` takes a keyword-only `out` argument (an out= buffer)."""
    try:
        parameter = inspect.signature(fn).parameters.get("out")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def describe_args(args: Any) -> str:
    """A short description of call arguments for explain() output."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"Tensor{list(a.shape)}:{str(a.dtype).removeprefix('torch.')}@{a.device}")
        elif isinstance(a, tuple) and all(isinstance(t, torch.Tensor) for t in a):
            parts.append(f"({describe_args(a)})")
        else:
            parts.append(repr(a))
    return ", ".join(parts)
