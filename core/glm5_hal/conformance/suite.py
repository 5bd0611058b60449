"""The suite: which (backend, case) pairs a run consists of, in a stable order.

Both entry points (the `glm5-hal conformance` command and the pytest plugin) build the same
plan from the same choices, so a run's items and their order depend only on the installed
backends and cases. This module is also the file the pytest plugin collects the suite from.
"""
from __future__ import annotations

import dataclasses

from .. import ops as _ops  # noqa: F401  (defines every op)
from ..errors import HalError
from ..opdef import OPS
from ..backend import REFERENCE
from . import cases as _cases
from .case import PRESETS, Case
from .record import ERROR, SKIP




@dataclasses.dataclass(frozen=True)
class Item:
    """One unit of work: a case for a backend, or (case None) a whole op the backend cannot
    run at all, with the status and reason to report for it."""
    backend: str
    op: str
    case: Case | None = None
    blocked: tuple[str, str] | None = None   # (status, reason) when case is None

    @property
    def id(self) -> str:
        return self.case.id if self.case is not None else f"{self.op}/*"

    @property
    def test_name(self) -> str:
        return f"{self.id}[{self.backend}]"


def default_backends() -> list[str]:
    """Every available backend except the reference."""
    import glm5_hal as hal
    return [r.name for r in hal.backends() if r.available and r.name != REFERENCE]


def resolve_backends(names: list[str] | None) -> list[str]:
    """The backends to test: `names` (checked) or the default; never empty."""
    import glm5_hal as hal
    if not names:
        chosen = default_backends()
        if not chosen:
            rows = ", ".join(f"{r.name} ({r.error or r.reason})" for r in hal.backends()
                             if r.name != REFERENCE)
            raise HalError("conformance: no available backend besides the reference to test "
                           f"(registered: {rows or 'none'}); name one explicitly to see it skipped")
        return chosen
    known = {r.name for r in hal.backends()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise HalError(f"conformance: unknown backend(s) {unknown}; registered: {sorted(known)}")
    return list(dict.fromkeys(names))


def resolve_ops(names: list[str] | None) -> list[str]:
    """The ops to test: `names` (checked against the registry) or every op with cases."""
    if not names:
        return _cases.ops_with_cases()
    unknown = [n for n in names if n not in OPS]
    if unknown:
        raise HalError(f"conformance: unknown op(s) {unknown}; ops: {sorted(OPS)}")
    return list(dict.fromkeys(names))


def ops_without_cases() -> list[str]:
    return sorted(set(OPS) - set(_cases.ops_with_cases()))


def resolve_presets(names: list[str] | None) -> list[str]:
    if not names:
        return list(PRESETS)
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise HalError(f"conformance: unknown preset(s) {unknown}; presets: {list(PRESETS)} "
                       "('long' is for benchmarks only)")
    return list(dict.fromkeys(names))


def plan(backends: list[str], ops: list[str], presets: list[str]) -> list[Item]:
    """Items in backend, op, preset, case order. An unavailable backend gets one skip per op
    (the probe's reason); a quarantined plugin one error per op (its exception)."""
    import glm5_hal as hal
    rows = {r.name: r for r in hal.backends()}
    per_op = {op: [c for p in presets for c in _cases.cases(op, p)] for op in ops}
    items: list[Item] = []
    for backend in backends:
        row = rows.get(backend)
        if row is None:
            blocked = (ERROR, f"backend {backend!r} is not registered in this process")
        elif row.error:
            blocked = (ERROR, f"plugin quarantined: {row.error}")
        elif not row.available:
            blocked = (SKIP, f"backend unavailable: {row.reason}")
        else:
            blocked = None
        for op in ops:
            if blocked:
                items.append(Item(backend, op, None, blocked))
            else:
                items.extend(Item(backend, op, case) for case in per_op[op])
    return items
