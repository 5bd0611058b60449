"""What got worse between two conformance reports (`glm5-hal conformance diff OLD NEW`).

Either side is a run report (`glm5-hal conformance --json`) or a merged matrix
(`glm5-hal conformance merge --json`); cases are matched by column (backend @ chip) and case
id. The findings, per (column, case):

- regression: failing (fail or error) in NEW and not failing in OLD: passing, declined
  (fallback, skip), or missing there -- a new case, or a case of a new column, that fails
  counts too;
- new fallback: pass -> fallback (the backend stopped taking the call: the reference ran);
- lost coverage: pass -> skip; a case of OLD that NEW lacks, whatever its status (a failing
  case that is no longer run is hidden, not fixed); and every column of OLD that NEW lacks;
- drift: passing on both sides, but the margin grew by more than `drift` (margins are
  fractions of the tolerance bound, so 0.25 means a quarter of the bound was used up);
- fixed: fail or error -> pass; and the new cases, counted by status.

Which findings make the command exit 1 is the caller's choice (`fail_on`); by default every
kind but drift. A NEW side without a single record (a run that tested nothing) always fails.
"""
from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

from .matrix import MATRIX_KIND, RunReport, merge, number, read_json
from .record import CONTRACT, ERROR, FAIL, FALLBACK, PASS, SKIP, Record
from .schema import check_matrix, check_run

KINDS = ("regression", "fallback", "coverage", "drift")
#: what fails the diff unless --fail-on says otherwise: every case that is not passing in NEW
#: and was passing, missing or declined in OLD, and every lost column
DEFAULT_FAIL_ON = ("regression", "fallback", "coverage")
#: the finding no --fail-on can leave out: NEW holds no records at all
EMPTY = "empty"
DEFAULT_DRIFT = 0.25
MISSING = "missing"
_PASSING = (PASS, CONTRACT)   # contract: certification's name for an expected error the op's checks decided
_FAILING = (FAIL, ERROR)


@dataclasses.dataclass
class Side:
    """One side of a diff: per column, case -> (status, margin); plus its columns' facts."""
    source: str
    records: dict[str, dict[str, tuple[str, float | None]]]
    columns: dict[str, dict]


def load(path: str | Path) -> Side:
    """A side read from `path`, checked (schema): a run report, merged as `merge` would, or a
    merged matrix. A run report without records is read (it is a finding, not an input error)."""
    data = read_json(path)
    if isinstance(data, dict) and data.get("kind") == MATRIX_KIND:
        check_matrix(data, str(path))
    else:
        check_run(data, str(path))
        data = merge([RunReport(str(path), data["meta"], [Record.from_dict(r) for r in data["records"]])])
    records = {col: {case: (v[0], number(v[1])) for case, v in cases.items()}
               for col, cases in data["records"].items()}
    return Side(str(path), records, {c["key"]: c for c in data["columns"]})


@dataclasses.dataclass
class Change:
    column: str
    case: str
    old: str
    new: str
    old_margin: float | None = None
    new_margin: float | None = None


@dataclasses.dataclass
class Diff:
    regressions: list[Change]
    fallbacks: list[Change]
    lost: list[Change]
    drift: list[Change]
    fixed: list[Change]
    new_cases: dict[str, dict[str, int]]     # column -> status -> count
    lost_columns: list[str]
    new_columns: list[str]
    notes: list[str]                          # differences between the two sides' runs
    threshold: float
    empty: bool = False                       # NEW holds no records

    def failing(self, fail_on: tuple[str, ...]) -> list[str]:
        """The kinds of finding, among `fail_on`, that are present; `empty` whatever `fail_on`."""
        present = {"regression": self.regressions, "fallback": self.fallbacks,
                   "coverage": self.lost or self.lost_columns, "drift": self.drift}
        return [EMPTY] * self.empty + [k for k in fail_on if present[k]]

    def to_dict(self) -> dict:
        as_list = lambda changes: [dataclasses.asdict(c) for c in changes]
        return {"regressions": as_list(self.regressions), "new_fallbacks": as_list(self.fallbacks),
                "lost_coverage": as_list(self.lost), "drift": as_list(self.drift),
                "fixed": as_list(self.fixed), "new_cases": self.new_cases,
                "lost_columns": self.lost_columns, "new_columns": self.new_columns,
                "notes": self.notes, "drift_threshold": self.threshold, "empty_new": self.empty}


def compare(old: Side, new: Side, drift: float = DEFAULT_DRIFT) -> Diff:
    d = Diff([], [], [], [], [], {}, [c for c in old.records if c not in new.records],
             [c for c in new.records if c not in old.records], _notes(old, new), drift,
             empty=not any(new.records.values()))
    for column, old_cases in old.records.items():
        new_cases = new.records.get(column, {})
        for case, (status, margin) in old_cases.items():
            now, now_margin = new_cases.get(case, (MISSING, None))
            change = Change(column, case, status, now, margin, now_margin)
            if now in _FAILING and status not in _FAILING:
                d.regressions.append(change)
            elif now == MISSING:   # whatever it was: a failure that is no longer run is hidden, not fixed
                d.lost.append(change)
            elif status in _PASSING:
                if now == FALLBACK:
                    d.fallbacks.append(change)
                elif now == SKIP:
                    d.lost.append(change)
                elif margin is not None and now_margin is not None and now_margin - margin > drift:
                    d.drift.append(change)
            elif status in _FAILING and now in _PASSING:
                d.fixed.append(change)
    for column, new_cases in new.records.items():
        old_cases = old.records.get(column, {})
        added = {case: v for case, v in new_cases.items() if case not in old_cases}
        d.regressions += [Change(column, case, MISSING, s, None, m) for case, (s, m) in added.items()
                          if s in _FAILING]
        if added:
            d.new_cases[column] = dict(collections.Counter(s for s, _ in added.values()))
    return d


def _notes(old: Side, new: Side) -> list[str]:
    notes = []
    for column in old.columns.keys() & new.columns.keys():
        a, b = old.columns[column], new.columns[column]
        for field in ("glm5_hal", "torch", "versions", "reference", "presets"):
            if a.get(field) != b.get(field):
                notes.append(f"{column}: {field} {_show(a.get(field))} -> {_show(b.get(field))}")
        if a.get("machine", {}).get("cpu") != b.get("machine", {}).get("cpu"):
            notes.append(f"{column}: machine {a.get('machine', {}).get('cpu', '?')} -> "
                         f"{b.get('machine', {}).get('cpu', '?')}")
    return notes


def _show(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} {x}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def format_diff(d: Diff, old: str, new: str, *, limit: int = 50) -> str:
    lines = [f"conformance diff {old} -> {new}"]
    if d.empty:
        lines.append(f"NEW holds no records: the run tested nothing ({new})")
    lines += [f"note: {n}" for n in d.notes]
    lines += [f"column gone: {c}" for c in d.lost_columns]
    lines += [f"new column: {c}" for c in d.new_columns]

    def section(title: str, changes: list[Change], show) -> None:
        lines.append(f"{title}: {len(changes)}")
        for c in changes[:limit]:
            lines.append(f"  {c.column}  {c.case}  {show(c)}")
        if len(changes) > limit:
            lines.append(f"  ... and {len(changes) - limit} more (--json lists all)")

    margin = lambda m: "-" if m is None else f"{m:.3g}"
    section("regressions (pass, fallback, skip or missing -> fail/error)", d.regressions,
            lambda c: f"{c.old} -> {c.new} (margin {margin(c.new_margin)})")
    section("new fallbacks (pass -> fallback)", d.fallbacks, lambda c: f"{c.old} -> {c.new}")
    section("lost coverage (pass -> skip, or gone)", d.lost, lambda c: f"{c.old} -> {c.new}")
    section(f"margin drift (> +{d.threshold:g})", d.drift,
            lambda c: f"margin {margin(c.old_margin)} -> {margin(c.new_margin)}")
    section("fixed (fail/error -> pass)", d.fixed, lambda c: f"{c.old} -> {c.new}")
    for column, counts in d.new_cases.items():
        lines.append(f"new cases in {column}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
