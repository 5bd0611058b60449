"""Reports of a run: terminal matrix, JSON, JUnit XML, Markdown.

All of them are built from the list of `Record`s plus the run's metadata, so every format
says the same thing.
"""
from __future__ import annotations

import collections
import datetime
import json
import platform
import shlex
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from .record import CONTRACT, ERROR, FAIL, FALLBACK, PASS, SKIP, STATUSES, Record

# 2: meta.machine and meta.command; records carry inputs and note
JSON_SCHEMA_VERSION = 2


def metadata(backends: list[str], ops: list[str], presets: list[str], ref: str,
             workers: int, command: str | None = None) -> dict:
    """Run facts a reader needs to reproduce or compare a report. `command` is the command
    line that reproduces the run (default: this process's arguments)."""
    import torch
    import glm5_hal as hal
    from .machine import machine
    from .runner import REFERENCE_MODES
    from .suite import ops_without_cases
    rows = {r.name: r for r in hal.backends()}
    device, dtype = REFERENCE_MODES[ref]
    return {
        "schema": JSON_SCHEMA_VERSION,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "glm5_hal": hal.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "reference": {"mode": ref, "device": device, "dtype": str(dtype).removeprefix("torch."),
                      "device_name": torch.cuda.get_device_name() if ref == "cuda" else platform.processor() or platform.machine()},
        "backends": {name: _backend_meta(rows.get(name)) for name in backends},
        "ops": ops,
        "ops_without_cases": ops_without_cases(),
        "presets": presets,
        "workers": workers,
        "argv": sys.argv[1:],
        "command": command or shlex.join(sys.argv),
        "machine": machine(),
    }


def _backend_meta(row) -> dict:
    if row is None:
        return {"registered": False}
    caps = row.capabilities
    return {"device_type": row.device_type, "available": row.available, "reason": row.error or row.reason,
            "versions": row.versions, "device_name": caps.device_name if caps else "",
            "plugin": row.plugin}


def counts(records: list[Record]) -> dict[tuple[str, str], collections.Counter]:
    """(op, backend) -> Counter of statuses."""
    table: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        table[(r.op, r.backend)][r.status] += 1
    return table


def totals(records: list[Record]) -> collections.Counter:
    return collections.Counter(r.status for r in records)


def failed(records: list[Record]) -> bool:
    """A run fails iff any record failed or errored."""
    return any(r.status in (FAIL, ERROR) for r in records)


def _axes(records: list[Record]) -> tuple[list[str], list[str]]:
    ops = list(dict.fromkeys(r.op for r in records))
    backends = list(dict.fromkeys(r.backend for r in records))
    return ops, backends


def _cell(c: collections.Counter) -> str:
    return ", ".join(f"{c[s]} {s}" for s in STATUSES if c[s]) or "-"


# -- terminal ------------------------------------------------------------------------------
def format_matrix(records: list[Record], *, max_problems: int = 20) -> str:
    """Ops x backends with status counts, then the problems (fail/error first)."""
    ops, backends = _axes(records)
    table = counts(records)
    header = ["op"] + backends
    rows = [[op] + [_cell(table[(op, b)]) for b in backends] for op in ops]
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    t = totals(records)
    out.append("")
    out.append("total: " + (", ".join(f"{t[s]} {s}" for s in STATUSES if t[s]) or "nothing ran"))
    problems = [r for r in records if r.status in (FAIL, ERROR)] + \
               [r for r in records if r.status == FALLBACK]
    if problems:
        out.append("")
        for r in problems[:max_problems]:
            out.append(f"{r.status.upper():<8} {r.backend} {r.case}: {one_line(r.reason)}")
        if len(problems) > max_problems:
            out.append(f"... and {len(problems) - max_problems} more (see --json)")
    return "\n".join(out)


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- JSON ----------------------------------------------------------------------------------
def to_json(records: list[Record], meta: dict) -> dict:
    return {"meta": meta, "summary": dict(totals(records)),
            "records": [r.to_dict() for r in records]}


def write_json(path: str | Path, records: list[Record], meta: dict) -> None:
    write_text(path, json.dumps(to_json(records, meta), indent=1, allow_nan=False) + "\n")


# -- JUnit XML -----------------------------------------------------------------------------
def to_junit(records: list[Record], meta: dict) -> ET.Element:
    """One <testsuite> per backend, one <testcase> per record: fail -> <failure>,
    error -> <error>, skip and fallback -> <skipped> (a fallback is not a pass)."""
    root = ET.Element("testsuites", name="glm5_hal.conformance")
    by_backend: dict[str, list[Record]] = collections.defaultdict(list)
    for r in records:
        by_backend[r.backend].append(r)
    for backend, rows in by_backend.items():
        t = totals(rows)
        suite = ET.SubElement(root, "testsuite", name=f"glm5_hal.conformance[{backend}]",
                              tests=str(len(rows)), failures=str(t[FAIL]), errors=str(t[ERROR]),
                              skipped=str(t[SKIP] + t[FALLBACK]),
                              time=f"{sum(r.duration_ms for r in rows) / 1e3:.3f}",
                              timestamp=meta.get("timestamp", ""))
        props = ET.SubElement(suite, "properties")
        for key in ("glm5_hal", "torch", "platform"):
            ET.SubElement(props, "property", name=key, value=str(meta.get(key, "")))
        ET.SubElement(props, "property", name="reference", value=str(meta.get("reference", {}).get("mode", "")))
        ET.SubElement(props, "property", name="backend_versions",
                      value=json.dumps(meta.get("backends", {}).get(backend, {}).get("versions", {})))
        for r in rows:
            case = ET.SubElement(suite, "testcase", classname=f"glm5_hal.conformance.{backend}.{r.op}",
                                 name=r.case, time=f"{r.duration_ms / 1e3:.4f}")
            if r.status == FAIL:
                ET.SubElement(case, "failure", message=one_line(r.reason), type="ConformanceFailure").text = _details(r)
            elif r.status == ERROR:
                ET.SubElement(case, "error", message=one_line(r.reason), type="BackendError").text = _details(r)
            elif r.status == SKIP:
                ET.SubElement(case, "skipped", message=one_line(r.reason))
            elif r.status == FALLBACK:
                ET.SubElement(case, "skipped", message=one_line(f"fallback: {r.reason}"))
    return root


def write_junit(path: str | Path, records: list[Record], meta: dict) -> None:
    root = to_junit(records, meta)
    ET.indent(root)
    write_text(path, ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n")


def _details(r: Record) -> str:
    d = r.to_dict()
    keep = ("impl", "device", "max_abs", "max_rel", "atol", "rtol", "margin", "swaps", "worst", "outputs")
    return r.reason + "\n" + json.dumps({k: d[k] for k in keep if d[k] not in (None, "", [])}, indent=1)


# -- Markdown ------------------------------------------------------------------------------
_MARK = {PASS: "✅", FAIL: "❌", ERROR: "❌", FALLBACK: "⚠️", SKIP: "⏭️", CONTRACT: "☑️"}


def to_markdown(records: list[Record], meta: dict, *, max_problems: int = 50) -> str:
    ops, backends = _axes(records)
    table = counts(records)
    ref = meta.get("reference", {})
    lines = ["## glm5_hal conformance", "",
             f"glm5_hal {meta.get('glm5_hal', '?')} · torch {meta.get('torch', '?')} · reference "
             f"{ref.get('mode', '?')} ({ref.get('dtype', '?')}) · presets "
             f"{', '.join(meta.get('presets', []))} · {meta.get('timestamp', '')}", ""]
    devices = [f"`{b}`: {meta.get('backends', {}).get(b, {}).get('device_name') or '?'}" for b in backends]
    if devices:
        lines += ["Devices: " + "; ".join(devices), ""]
    if meta.get("machine"):
        from .machine import describe
        lines += [f"Machine: {describe(meta['machine'])}", ""]
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines.append("| op | " + " | ".join(f"`{b}`" for b in backends) + " |")
    lines.append("|---|" + "---|" * len(backends))
    for op in ops:
        cells = []
        for b in backends:
            c = table[(op, b)]
            worst = next((s for s in (FAIL, ERROR, FALLBACK, SKIP, PASS, CONTRACT) if c[s]), None)
            cells.append(f"{_MARK[worst]} {_cell(c)}" if worst else "-")
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    if meta.get("ops_without_cases"):
        lines += ["", "Ops without conformance cases yet: " +
                  ", ".join(f"`{o}`" for o in meta["ops_without_cases"])]
    problems = [r for s in (FAIL, ERROR, FALLBACK, SKIP) for r in records if r.status == s]
    if problems:
        lines += ["", "### Not passing", "", "| backend | case | status | reason |", "|---|---|---|---|"]
        for r in problems[:max_problems]:
            reason = one_line(r.reason, 200).replace("|", "\\|")
            lines.append(f"| `{r.backend}` | `{r.case}` | {r.status} | {reason} |")
        if len(problems) > max_problems:
            lines.append(f"\n... and {len(problems) - max_problems} more (see the JSON report)")
    for backend, verdict in meta.get("certification", {}).items():
        lines += _certification_markdown(backend, verdict)
    return "\n".join(lines) + "\n"


def _certification_markdown(backend: str, v: dict) -> list[str]:
    """A certify run's verdict: problems, every declared cell's coverage, every declined case."""
    cell = lambda text: one_line(str(text), 300).replace("|", "\\|")
    lines = ["", f"### Certification of `{backend}`: {'certified' if v['certified'] else 'NOT certified'}", ""]
    lines += [f"- {cell(p)}" for p in v["problems"]]
    if v.get("cells"):
        lines += ["", f"Declared op and dtype cells (certification needs a served share of at least "
                      f"{v['min_served_share']:.0%}):", "",
                  "| op | dtype | served | declined | contract | share |", "|---|---|---|---|---|---|"]
        lines += [f"| `{c['op']}` | {c['dtype']} | {c['served']} | {c['declined']} | {c['contract']} | "
                  f"{c['share']:.0%}{'' if c['ok'] else ' ❌'} |" for c in v["cells"]]
    if v.get("declined"):
        lines += ["", f"Declined cases ({len(v['declined'])}):", "", "| case | reason |", "|---|---|"]
        lines += [f"| `{d['case']}` | {cell(d['reason'])} |" for d in v["declined"]]
    return lines


def write_markdown(path: str | Path, records: list[Record], meta: dict) -> None:
    write_text(path, to_markdown(records, meta))


def write_text(path: str | Path, text: str) -> None:
    """Writes a report file, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
