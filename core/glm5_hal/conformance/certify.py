"""Certification (`glm5-hal conformance --backend B --certify`): a run that cannot pass empty.

On top of the ordinary rules (every case passes or is a declared fallback), certifying a
backend requires that
- every op it declares is served by its own implementation, for every dtype it declares that
  its device supports: an (op, dtype) whose cases all end in fallback means the backend
  claims an op it never runs, and fails the certification;
- expected-error cases that the op's own checks rejected before any backend ran are reported
  as `contract`, not as the backend's passes (the backend did nothing for them);
and the report records the backend's vendor package versions and chip (run metadata).
"""
from __future__ import annotations

import dataclasses

from .record import CONTRACT, ERROR, FAIL, PASS, SKIP, Record

_REJECTED = "rejected with InvalidInputError: "


def relabel(records: list[Record]) -> list[Record]:
    """Expected-error passes that no implementation took part in (dispatch chose nothing:
    the contract rejected the inputs) become `contract`."""
    out = []
    for r in records:
        if r.status == PASS and not r.impl and r.reason.startswith(_REJECTED):
            r = dataclasses.replace(r, status=CONTRACT, reason="rejected by the op's own checks before any "
                                    "backend ran: " + r.reason[len(_REJECTED):])
        out.append(r)
    return out


def unserved(records: list[Record], backend: str, declared: dict[str, frozenset | None]) -> list[str]:
    """The (op, dtype) pairs `backend` declares (op -> its declared dtypes, None for any) that
    have cases in `records` but none its own implementation ran; each with the reason dispatch
    gave. Pairs whose every case was skipped (the device lacks the dtype) are not claimed."""
    by_pair: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        if r.backend == backend and r.dtype:
            by_pair.setdefault((r.op, r.dtype), []).append(r)
    problems = []
    for (op, dtype), rs in sorted(by_pair.items()):
        dtypes = declared.get(op, ())
        if op not in declared or (dtypes is not None and dtype not in {str(d).removeprefix("torch.") for d in dtypes}):
            continue
        if all(r.status == SKIP for r in rs):
            continue
        if not any(r.impl == f"{backend}.{op}" for r in rs):
            reasons = sorted({r.reason for r in rs if r.status not in (PASS, CONTRACT)})
            problems.append(f"{op} [{dtype}]: declared, but every case fell back ({'; '.join(reasons)[:300]})")
    return problems


def verdict(records: list[Record], backends: list[str]) -> dict:
    """{backend: {"certified": bool, "problems": [...]}} for the backends of a certify run."""
    import glm5_hal as hal
    result = {}
    for name in backends:
        backend = hal.get_backend(name)
        declared = {op: impl.dtypes for op, impl in backend.impls.items()}
        mine = [r for r in records if r.backend == name]
        problems = [f"{r.case}: {r.status}: {r.reason[:200]}" for r in mine if r.status in (FAIL, ERROR)]
        if not backend.availability().available:
            problems.insert(0, f"unavailable: {backend.availability().reason}")
        problems += unserved(mine, name, declared)
        result[name] = {"certified": not problems, "problems": problems,
                        "served": sum(r.status == PASS for r in mine),
                        "contract": sum(r.status == CONTRACT for r in mine)}
    return result


def format_verdict(result: dict) -> str:
    lines = []
    for name, v in result.items():
        if v["certified"]:
            lines.append(f"certified: {name} ({v['served']} cases served by its own implementations, "
                         f"{v['contract']} rejected by the ops' checks before it ran)")
        else:
            lines.append(f"NOT certified: {name}: {len(v['problems'])} problem(s)")
            lines += [f"  {p}" for p in v["problems"][:40]]
    return "\n".join(lines)
