"""What got worse between two conformance reports (`glm5-hal conformance diff OLD NEW`).

Either side is a run report (`glm5-hal conformance --json`) or a merged matrix
(`glm5-hal conformance merge --json`); cases are matched by column (backend @ chip) and case
id. The findings, per (column, case):

- regression: pass -> fail or error;
- new fallback: pass -> fallback (the backend stopped taking the call: the reference ran);
- lost coverage: pass -> skip, or the case (or the whole column) is gone;
- drift: passing on both sides, but the margin grew by more than `drift` (margins are
  fractions of the tolerance bound, so 0.25 means a quarter of the bound was used up);
- fixed: fail or error -> pass; and the new cases, counted by status.

Which findings make the command exit 1 is the caller's choice (`fail_on`); by default only
regressions.
"""
from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

from ..errors import HalError
from .matrix import MATRIX_KIND, RunReport, merge, number, read_json
from .record import ERROR, FAIL, FALLBACK, PASS, SKIP, Record

KINDS = ("regression", "fallback", "coverage", "drift")
DEFAULT_DRIFT = 0.25


@dataclasses.dataclass
class Side:
    """One side of a diff: per column, case -> (status, margin); plus its columns' facts."""
    source: str
    records: dict[str, dict[str, tuple[str, float | None]]]
    columns: dict[str, dict]


def load(path: str | Path) -> Side:
    data = read_json(path)
    if data.get("kind") != MATRIX_KIND:
        if "records" not in data or "meta" not in data:
            raise HalError(f"conformance diff: {path} is neither a conformance report nor a merged matrix")
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

    def failing(self, fail_on: tuple[str, ...]) -> list[str]:
        """The kinds of finding, among `fail_on`, that are present."""
        present = {"regression": self.regressions, "fallback": self.fallbacks,
                   "coverage": self.lost, "drift": self.drift}
        return [k for k in fail_on if present[k]]

    def to_dict(self) -> dict:
        as_list = lambda changes: [dataclasses.asdict(c) for c in changes]
        return {"regressions": as_list(self.regressions), "new_fallbacks": as_list(self.fallbacks),
                "lost_coverage": as_list(self.lost), "drift": as_list(self.drift),
                "fixed": as_list(self.fixed), "new_cases": self.new_cases,
                "lost_columns": self.lost_columns, "new_columns": self.new_columns,
                "notes": self.notes, "drift_threshold": self.threshold}


def compare(old: Side, new: Side, drift: float = DEFAULT_DRIFT) -> Diff:
    d = Diff([], [], [], [], [], {}, [c for c in old.records if c not in new.records],
             [c for c in new.records if c not in old.records], _notes(old, new), drift)
    for column, old_cases in old.records.items():
        new_cases = new.records.get(column, {})
        for case, (status, margin) in old_cases.items():
            now, now_margin = new_cases.get(case, ("missing", None))
            change = Change(column, case, status, now, margin, now_margin)
            if status == PASS:
                if now in (FAIL, ERROR):
                    d.regressions.append(change)
                elif now == FALLBACK:
                    d.fallbacks.append(change)
                elif now in (SKIP, "missing"):
                    d.lost.append(change)
                elif margin is not None and now_margin is not None and now_margin - margin > drift:
                    d.drift.append(change)
            elif status in (FAIL, ERROR) and now == PASS:
                d.fixed.append(change)
    for column, new_cases in new.records.items():
        old_cases = old.records.get(column, {})
        added = collections.Counter(s for case, (s, _) in new_cases.items() if case not in old_cases)
        if added:
            d.new_cases[column] = dict(added)
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
    section("regressions (pass -> fail/error)", d.regressions,
            lambda c: f"{c.old} -> {c.new} (margin {margin(c.new_margin)})")
    section("new fallbacks (pass -> fallback)", d.fallbacks, lambda c: f"{c.old} -> {c.new}")
    section("lost coverage (pass -> skip or gone)", d.lost, lambda c: f"{c.old} -> {c.new}")
    section(f"margin drift (> +{d.threshold:g})", d.drift,
            lambda c: f"margin {margin(c.old_margin)} -> {margin(c.new_margin)}")
    section("fixed (fail/error -> pass)", d.fixed, lambda c: f"{c.old} -> {c.new}")
    for column, counts in d.new_cases.items():
        lines.append(f"new cases in {column}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
