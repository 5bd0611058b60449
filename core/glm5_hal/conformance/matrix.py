"""Many reports, one matrix: what passes where (`glm5-hal conformance merge`).

Each input is a report of `glm5-hal conformance --json` (one lab, one machine). A *column*
is one backend on one chip ("backend @ chip", the chip being the backend's device name);
a *row* is one op in one dtype; a cell counts the statuses of that row's cases in that
column. The matrix also keeps, per column, every case's status and margin (what `diff`
compares), every failing case in full, and the fallbacks and skips grouped by reason.

Reports made by different glm5_hal versions, with another reference, or over other case
sets are merged anyway, and every such difference is stated in `differences`.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import json
from pathlib import Path

from ..errors import HalError
from .record import CONTRACT, ERROR, FAIL, FALLBACK, PASS, SKIP, STATUSES, Record, json_safe
from .report import one_line, write_text
from .schema import check_run

MATRIX_KIND = "glm5_hal.conformance.matrix"
MATRIX_SCHEMA = 1
WORST_FIRST = (FAIL, ERROR, FALLBACK, SKIP, PASS, CONTRACT)
DTYPE_ORDER = ("float32", "float16", "bfloat16", "float8_e4m3fn", "int32", "")
_ROW_DTYPE_ALL = "*"   # the row of whole-op records (an unavailable backend's one skip per op)


@dataclasses.dataclass
class RunReport:
    """One input: a report of `glm5-hal conformance --json`."""
    source: str
    meta: dict
    records: list[Record]


def load_run(path: str | Path) -> RunReport:
    """The run report in `path`, checked (schema.check_run), to merge. A report without
    records (a run that tested nothing) is refused: merged, it would drop a lab silently.
    (`diff` reads such a report, and fails on it as NEW.)"""
    data = read_json(path)
    if isinstance(data, dict) and data.get("kind") == MATRIX_KIND:
        raise HalError(f"conformance merge: {path} is a merged matrix; merge the run reports "
                       "it was made from (glm5-hal conformance --json)")
    check_run(data, str(path))
    if not data["records"]:
        raise HalError(f"conformance: {path}: the report has no records (the run tested nothing)")
    return RunReport(str(path), data["meta"], [Record.from_dict(r) for r in data["records"]])


def read_json(path: str | Path):
    """The JSON in `path`, unchecked (any JSON value)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise HalError(f"conformance: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise HalError(f"conformance: {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise HalError(f"conformance: {path} is not JSON: {exc}") from None
    except RecursionError:
        raise HalError(f"conformance: {path}: JSON nested too deeply to be a report") from None


# -- columns ---------------------------------------------------------------------------------
def chip_of(meta: dict, backend: str) -> str:
    return meta.get("backends", {}).get(backend, {}).get("device_name") or "?"


def column_keys(reports: list[RunReport]) -> list[list[tuple[str, str]]]:
    """Per report, its (backend, column key) pairs in record order. Keys are `backend @ chip`;
    where two reports give the same key, the machine's CPU and then a number tell them apart."""
    pairs = [[(b, f"{b} @ {chip_of(r.meta, b)}") for b in dict.fromkeys(x.backend for x in r.records)]
             for r in reports]
    flat = collections.Counter(k for p in pairs for _, k in p)
    taken: set[str] = set()
    result = []
    for report, p in zip(reports, pairs):
        keyed = []
        for backend, key in p:
            if flat[key] > 1:
                key = f"{key} ({report.meta.get('machine', {}).get('cpu', '?')})"
            unique, n = key, 2
            while unique in taken:
                unique, n = f"{key} #{n}", n + 1
            taken.add(unique)
            keyed.append((backend, unique))
        result.append(keyed)
    return result


def _column(key: str, backend: str, report: RunReport, cases: int) -> dict:
    meta = report.meta
    b = meta.get("backends", {}).get(backend, {})
    return {"key": key, "backend": backend, "chip": chip_of(meta, backend), "source": report.source,
            "glm5_hal": meta.get("glm5_hal", "?"), "torch": meta.get("torch", "?"),
            "versions": b.get("versions", {}), "available": b.get("available"),
            "reason": b.get("reason", ""), "machine": meta.get("machine", {}),
            "command": meta.get("command") or " ".join(["glm5-hal", *meta.get("argv", [])]),
            "timestamp": meta.get("timestamp", ""), "reference": meta.get("reference", {}),
            "presets": meta.get("presets", []), "cases": cases,
            "schema": meta.get("schema", 1)}


# -- the matrix ------------------------------------------------------------------------------
def merge(reports: list[RunReport]) -> dict:
    """The merged matrix of `reports` (a JSON-ready dict; see the module docstring)."""
    if not reports:
        raise HalError("conformance merge: no reports given")
    columns, per_column = [], {}
    for report, keyed in zip(reports, column_keys(reports)):
        for backend, key in keyed:
            records = [r for r in report.records if r.backend == backend]
            per_column[key] = records
            columns.append(_column(key, backend, report, sum(1 for r in records if not _whole_op(r))))
    return {
        "kind": MATRIX_KIND,
        "schema": MATRIX_SCHEMA,
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "columns": columns,
        "differences": differences(columns, per_column),
        "rows": _rows(per_column),
        "problems": [dict(r.to_dict(), column=key) for key, records in per_column.items()
                     for r in records if r.status in (FAIL, ERROR)],
        "declines": _declines(per_column),
        "records": {key: {r.case: [r.status, _round(r.margin)] for r in records}
                    for key, records in per_column.items()},
    }


def _whole_op(r: Record) -> bool:
    return r.case.endswith("/*")


def _row_dtype(r: Record) -> str:
    return _ROW_DTYPE_ALL if _whole_op(r) else r.dtype


def _dtype_rank(dtype: str) -> tuple[int, str]:
    return (DTYPE_ORDER.index(dtype) if dtype in DTYPE_ORDER else len(DTYPE_ORDER), dtype)


def _rows(per_column: dict[str, list[Record]]) -> list[dict]:
    cells: dict[tuple[str, str], dict[str, dict]] = collections.defaultdict(dict)
    for key, records in per_column.items():
        for r in records:
            cell = cells[(r.op, _row_dtype(r))].setdefault(key, {"counts": {}, "margin": None, "worst": None})
            cell["counts"][r.status] = cell["counts"].get(r.status, 0) + 1
            margin = number(r.margin)
            if margin is not None and (cell["margin"] is None or margin > cell["margin"]):
                cell["margin"], cell["worst"] = margin, r.case
    rows = []
    for op, dtype in sorted(cells, key=lambda k: (k[0], _dtype_rank(k[1]))):
        row_cells = cells[(op, dtype)]
        for cell in row_cells.values():
            cell["status"] = next(s for s in WORST_FIRST if cell["counts"].get(s))
            cell["counts"] = {s: cell["counts"][s] for s in STATUSES if s in cell["counts"]}
            cell["margin"] = _round(cell["margin"])
        rows.append({"op": op, "dtype": dtype, "cells": row_cells})
    return rows


def _declines(per_column: dict[str, list[Record]]) -> list[dict]:
    """Fallbacks and skips grouped by (column, op, status, reason): one line per distinct reason."""
    groups: dict[tuple, list[Record]] = collections.defaultdict(list)
    for key, records in per_column.items():
        for r in records:
            if r.status in (FALLBACK, SKIP):
                groups[(key, r.op, r.status, r.reason)].append(r)
    return [{"column": key, "op": op, "status": status, "reason": reason, "count": len(rs),
             "dtypes": sorted({_row_dtype(r) for r in rs}, key=_dtype_rank)}
            for (key, op, status, reason), rs in groups.items()]


def number(v) -> float | None:
    """Margins in JSON are numbers, or strings for non-finite values ("inf", "nan")."""
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _round(v):
    """Three significant digits: enough to see drift, stable under last-bit noise."""
    v = number(v)
    if v is None:
        return None
    return float(f"{v:.3g}") if v == v and abs(v) != float("inf") else str(v)


# -- stated differences ------------------------------------------------------------------------
def differences(columns: list[dict], per_column: dict[str, list[Record]]) -> list[str]:
    """Every way the merged reports are not alike: versions, references, case sets."""
    out = []
    for field, what in (("glm5_hal", "glm5_hal versions"), ("schema", "report schemas")):
        groups = _group(columns, lambda c: str(c[field]))
        if len(groups) > 1:
            out.append(f"{what} differ: " + "; ".join(f"{v} ({', '.join(keys)})" for v, keys in groups.items()))
    groups = _group(columns, lambda c: "{mode} ({dtype})".format(**{"mode": "?", "dtype": "?", **c["reference"]}))
    if len(groups) > 1:
        out.append("references differ: " + "; ".join(f"{v} ({', '.join(keys)})" for v, keys in groups.items()))
    case_sets = {key: {r.case for r in records if not _whole_op(r)} for key, records in per_column.items()}
    union = set().union(*case_sets.values())
    alike: dict[str, list[str]] = {}   # columns missing the same cases share one line
    for column in columns:
        key = column["key"]
        missing = union - case_sets[key]
        if missing:
            text = (f"ran {len(case_sets[key])} of the {len(union)} cases in these reports; missing: "
                    f"{_summarise_cases(missing, union)}"
                    + (f" (backend unavailable: {column['reason']})" if column["available"] is False else ""))
            alike.setdefault(text, []).append(key)
    out += [f"{', '.join(keys)} {text}" for text, keys in alike.items()]
    return out


def _group(columns: list[dict], value) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for c in columns:
        groups.setdefault(value(c), []).append(c["key"])
    return groups


def _summarise_cases(missing: set[str], union: set[str], limit: int = 6) -> str:
    """`missing` case ids in few words: whole presets first, then ops, then counts."""
    def split(case):
        op, preset = case.split("/")[:2]
        return op, preset
    parts, rest = [], set(missing)
    for preset in sorted({split(c)[1] for c in missing}):
        all_of = {c for c in union if split(c)[1] == preset}
        if all_of <= rest:
            parts.append(f"preset {preset} ({len(all_of)} cases)")
            rest -= all_of
    by_op = collections.Counter(split(c)[0] for c in rest)
    shown = [f"{op} ({n} cases)" for op, n in sorted(by_op.items())]
    if len(shown) > limit:
        shown = shown[:limit] + [f"{len(by_op) - limit} more ops ({sum(by_op.values())} cases in all)"]
    return ", ".join(parts + shown)


# -- writing ---------------------------------------------------------------------------------
def write_json(path: str | Path, matrix: dict) -> None:
    """Indented JSON, except `records`: one case per line, so that a checked-in baseline
    diffs line by line."""
    head = {k: v for k, v in matrix.items() if k != "records"}
    text = json.dumps(json_safe(head), indent=1, allow_nan=False)[:-2]
    blocks = []
    for key, cases in matrix["records"].items():
        lines = ",\n".join(f"   {json.dumps(case)}: {json.dumps(json_safe(v), allow_nan=False)}"
                           for case, v in cases.items())
        blocks.append(f"  {json.dumps(key)}: {{\n{lines}\n  }}")
    text += ',\n "records": {\n' + ",\n".join(blocks) + "\n }\n}\n"
    write_text(path, text)



# -- Markdown --------------------------------------------------------------------------------
_MARK = {PASS: "✅", FAIL: "❌", ERROR: "❌", FALLBACK: "⚠️", SKIP: "⏭️", CONTRACT: "☑️"}


def anchor(column: str, op: str, dtype: str) -> str:
    """The id of a cell's list of failing cases (Markdown and HTML use the same)."""
    text = f"cases-{column}-{op}-{dtype}"
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in text).lower()


def describe_cell(cell: dict) -> str:
    return ", ".join(f"{n} {s}" for s, n in cell["counts"].items())


def describe_worst(worst: dict | None) -> str:
    """The element that set a failing case's margin, in one line."""
    if not worst:
        return ""
    facts = {k: v for k, v in worst.items() if k not in ("target", "index")}
    where = worst.get("target", "")
    if "index" in worst:
        where += f" at {worst['index']}"
    shown = ", ".join(f"{k} {_short(v)}" for k, v in facts.items())
    return f"{where}: {shown}" if where else shown


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def to_markdown(matrix: dict, *, max_problems: int = 200) -> str:
    from .machine import describe
    columns = matrix["columns"]
    lines = ["## glm5_hal conformance matrix", "",
             f"{len(columns)} columns (backend @ chip) from "
             f"{len({c['source'] for c in columns})} reports · merged {matrix['generated']}", "",
             "| column | glm5_hal | versions | machine | reference | presets | cases | command |",
             "|---|---|---|---|---|---|---|---|"]
    for c in columns:
        ref = c["reference"]
        lines.append("| " + " | ".join(_md(x) for x in (
            f"`{c['key']}`", c["glm5_hal"], ", ".join(f"{k} {v}" for k, v in c["versions"].items()),
            describe(c["machine"]) if c["machine"] else "?",
            f"{ref.get('mode', '?')} ({ref.get('dtype', '?')})", ", ".join(c["presets"]), str(c["cases"]),
            f"`{c['command']}`")) + " |")
    if matrix["differences"]:
        lines += ["", "### Differences between the reports", ""]
        lines += [f"- {_md(d)}" for d in matrix["differences"]]
    lines += ["", "### Matrix", "",
              "| op | dtype | " + " | ".join(f"`{c['key']}`" for c in columns) + " |",
              "|---|---|" + "---|" * len(columns)]
    for row in matrix["rows"]:
        cells = []
        for c in columns:
            cell = row["cells"].get(c["key"])
            if cell is None:
                cells.append("-")
                continue
            text = f"{_MARK[cell['status']]} {describe_cell(cell)}"
            if cell["status"] in (FAIL, ERROR):
                text = f"[{text} (margin {cell['margin']})](#{anchor(c['key'], row['op'], row['dtype'])})"
            cells.append(text)
        lines.append(f"| `{row['op']}` | {row['dtype']} | " + " | ".join(cells) + " |")
    problems = matrix["problems"]
    if problems:
        lines += ["", "### Failing cases", ""]
        groups: dict[tuple, list[dict]] = {}
        for p in problems[:max_problems]:
            groups.setdefault((p["column"], p["op"], p["dtype"]), []).append(p)
        for (column, op, dtype), ps in groups.items():
            lines += [f'<a id="{anchor(column, op, dtype)}"></a>', "",
                      f"**`{column}` · `{op}` · {dtype}**", "",
                      "| case | status | margin | worst element | inputs | reason |", "|---|---|---|---|---|---|"]
            for p in ps:
                lines.append("| " + " | ".join(_md(x) for x in (
                    f"`{p['case']}`", p["status"], str(p["margin"]), describe_worst(p["worst"]),
                    p.get("inputs", ""), one_line(p["reason"], 300))) + " |")
            lines.append("")
        if len(problems) > max_problems:
            lines.append(f"... and {len(problems) - max_problems} more (see the JSON matrix)")
    if matrix["declines"]:
        lines += ["", "### Fallbacks and skips", "", "| column | op | status | cases | dtypes | reason |",
                  "|---|---|---|---|---|---|"]
        for d in matrix["declines"]:
            lines.append("| " + " | ".join(_md(x) for x in (
                f"`{d['column']}`", f"`{d['op']}`", d["status"], str(d["count"]), ", ".join(d["dtypes"]),
                one_line(d["reason"], 200))) + " |")
    return "\n".join(lines).rstrip() + "\n"


def _md(text: str) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def write_markdown(path: str | Path, matrix: dict) -> None:
    write_text(path, to_markdown(matrix))
