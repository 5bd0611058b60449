"""Certification (`glm5-hal conformance --backend B --certify`): a run that cannot pass empty.

On top of the ordinary rules (every case passes or is a declared fallback), certifying a
backend requires, for every op it declares and every dtype it declares for that op which its
device supports (a *cell*), that
- the backend serves the share of the cell's cases its declaration promises: declaring an op
  for a dtype promises its calls in that dtype. `supports()` may decline calls outside the
  backend's limits, but only a minority: its own implementation must take at least
  `MIN_SERVED_SHARE` (half) of the cell's cases, so a backend declining most cases is not
  certified, and one whose cases all fall back certainly not;
- every declined case carries the reason the backend states (the string its `supports()`
  returns); a decline with none (`supports()` returned False or raised) is a problem;
- expected-error cases that the op's own checks rejected before any backend ran are reported
  as `contract`, neither served nor declined (the backend did nothing for them);
and the verdict lists every cell's served and declined counts and every declined case with
its reason (undeclared ops and dtypes included), next to the backend's vendor package
versions and chip (run metadata).
"""
from __future__ import annotations

import collections
import dataclasses

from .record import CONTRACT, ERROR, FAIL, FALLBACK, PASS, SKIP, Record

_REJECTED = "rejected with InvalidInputError: "
#: the least share of a declared cell's cases (not skipped, not contract) that the backend's
#: own implementation must take (docs/conformance.md, "Certification")
MIN_SERVED_SHARE = 0.5
#: how dispatch words a decline the backend gave no reason for (opdef.select, runner._judge)
_UNSTATED = ("supports() returned ", "supports() raised ", "dispatch chose ")


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


@dataclasses.dataclass
class Cell:
    """One declared (op, dtype) of a backend in a certification run."""
    op: str
    dtype: str
    served: int        # cases the backend's own implementation took (pass, fail or error)
    declined: int      # fallbacks: its supports() declined
    contract: int      # decided by the op's checks before any backend ran

    @property
    def share(self) -> float:
        reached = self.served + self.declined
        return self.served / reached if reached else 1.0

    @property
    def ok(self) -> bool:
        return self.share >= MIN_SERVED_SHARE


def cells(records: list[Record], backend: str, declared: dict[str, frozenset | None]) -> list[Cell]:
    """The cells `backend` declares (op -> its declared dtypes, None for any) that have cases
    in `records`, each with its counts. Cells whose every case was skipped (the device lacks
    the dtype) are not claimed; nor are those with only contract cases."""
    own = lambda op: f"{backend}.{op}"
    by_pair: dict[tuple[str, str], list[Record]] = collections.defaultdict(list)
    for r in records:
        if r.backend == backend and r.dtype and r.op in declared and _declares(declared[r.op], r.dtype):
            by_pair[(r.op, r.dtype)].append(r)
    result = []
    for (op, dtype), rs in sorted(by_pair.items()):
        served = sum(r.status in (PASS, FAIL, ERROR) and r.impl == own(op) for r in rs)
        declined = sum(r.status == FALLBACK for r in rs)
        if served + declined:
            result.append(Cell(op, dtype, served, declined, sum(r.status == CONTRACT for r in rs)))
    return result


def _declares(dtypes: frozenset | None, dtype: str) -> bool:
    return dtypes is None or dtype in {str(d).removeprefix("torch.") for d in dtypes}


def coverage_problems(records: list[Record], backend: str, declared: dict[str, frozenset | None]) -> list[str]:
    """The declared cells `backend` serves less than promised, and its declines without a
    stated reason."""
    problems = []
    for c in cells(records, backend, declared):
        if c.served == 0:
            problems.append(f"{c.op} [{c.dtype}]: declared, but every case fell back ({c.declined} declined)")
        elif not c.ok:
            problems.append(f"{c.op} [{c.dtype}]: declines most cases: served {c.served} of "
                            f"{c.served + c.declined} ({c.share:.0%}; certification needs "
                            f"{MIN_SERVED_SHARE:.0%})")
    for r in records:
        if (r.backend == backend and r.status == FALLBACK and r.op in declared
                and _declares(declared[r.op], r.dtype) and (not r.reason.strip() or r.reason.startswith(_UNSTATED))):
            problems.append(f"{r.case}: declined without a stated reason ({r.reason or 'none'})")
    return problems


def declined_cases(records: list[Record], backend: str) -> list[dict]:
    """Every case of `backend` that fell back, with the reason dispatch gave."""
    return [{"case": r.case, "reason": r.reason} for r in records if r.backend == backend and r.status == FALLBACK]


def verdict(records: list[Record], backends: list[str]) -> dict:
    """{backend: {"certified", "problems", "served", "contract", "cells", "declined"}} for the
    backends of a certify run."""
    import glm5_hal as hal
    result = {}
    for name in backends:
        backend = hal.get_backend(name)
        declared = {op: impl.dtypes for op, impl in backend.impls.items()}
        mine = [r for r in records if r.backend == name]
        problems = [f"{r.case}: {r.status}: {r.reason[:200]}" for r in mine if r.status in (FAIL, ERROR)]
        if not backend.availability().available:
            problems.insert(0, f"unavailable: {backend.availability().reason}")
        problems += coverage_problems(mine, name, declared)
        result[name] = {"certified": not problems, "problems": problems,
                        "served": sum(r.status == PASS for r in mine),
                        "contract": sum(r.status == CONTRACT for r in mine),
                        "min_served_share": MIN_SERVED_SHARE,
                        "cells": [dict(dataclasses.asdict(c), share=round(c.share, 4), ok=c.ok)
                                  for c in cells(mine, name, declared)],
                        "declined": declined_cases(mine, name)}
    return result


def format_verdict(result: dict, *, max_problems: int = 40, max_cases: int = 8) -> str:
    """The verdicts for a terminal: problems, then every declined case grouped by reason (the
    JSON report lists them one by one)."""
    lines = []
    for name, v in result.items():
        if v["certified"]:
            lines.append(f"certified: {name} ({v['served']} cases served by its own implementations, "
                         f"{v['contract']} rejected by the ops' checks before it ran)")
        else:
            lines.append(f"NOT certified: {name}: {len(v['problems'])} problem(s)")
            lines += [f"  {p}" for p in v["problems"][:max_problems]]
            if len(v["problems"]) > max_problems:
                lines.append(f"  ... and {len(v['problems']) - max_problems} more (see --json)")
        groups: dict[str, list[str]] = {}
        for d in v["declined"]:
            groups.setdefault(d["reason"], []).append(d["case"])
        if groups:
            lines.append(f"  declined cases of {name}: {len(v['declined'])}")
        for reason, cases in groups.items():
            shown = ", ".join(cases[:max_cases]) + (f", ... ({len(cases) - max_cases} more)"
                                                    if len(cases) > max_cases else "")
            lines.append(f"    {len(cases)} x {reason[:200]}: {shown}")
    return "\n".join(lines)
