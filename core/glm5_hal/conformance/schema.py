"""Checks that a report read from a file has the shape this glm5_hal reads, before anything
uses it: a run report (`glm5-hal conformance --json`) or a merged matrix (`conformance merge
--json`). A file of another shape, an unknown schema version or an unknown status is refused
with one line naming the file and what is wrong (`HalError`: the CLI's exit status 2), so that
`merge` and `diff` never crash on a report, and never read one they do not understand.

Only what the readers use is checked: the fields merge, diff and the Markdown and HTML pages
read, with their JSON types. Unknown extra fields are allowed (a report may carry more).
"""
from __future__ import annotations

from ..errors import HalError
from .record import STATUSES

#: run report schemas this glm5_hal reads (report.JSON_SCHEMA_VERSION and older); a report
#: without meta.schema is a schema 1 report
RUN_SCHEMAS = (1, 2)
#: merged matrix schemas this glm5_hal reads (matrix.MATRIX_SCHEMA)
MATRIX_SCHEMAS = (1,)

_NUMBER = (int, float)
# JSON has no NaN or infinity: margins and errors are numbers, strings ("inf", "nan") or null
_MEASURE = (int, float, str, type(None))
_RECORD_REQUIRED = ("backend", "device", "op", "case", "preset", "dtype", "status")
_RECORD_OPTIONAL = {"reason": str, "impl": str, "inputs": str, "note": str,
                    "max_abs": _MEASURE, "max_rel": _MEASURE, "atol": _MEASURE, "rtol": _MEASURE,
                    "margin": _MEASURE, "swaps": (int, type(None)), "duration_ms": _NUMBER,
                    "worst": (dict, type(None)), "outputs": list}
_META = {"glm5_hal": str, "torch": str, "timestamp": str, "command": str, "argv": list,
         "reference": dict, "backends": dict, "machine": dict, "presets": list}
_COLUMN = {"key": str, "glm5_hal": str, "torch": str, "versions": dict, "reference": dict,
           "presets": list, "machine": dict, "source": str, "command": str}


class ReportShapeError(HalError):
    """A report file this glm5_hal cannot read; the message names the file and the fault."""


def check_run(data, source: str) -> None:
    """Refuses `data` (parsed JSON from `source`) unless it is a run report of a known schema
    whose every record has the fields and statuses the readers use."""
    fail = _failer(source)
    if not isinstance(data, dict):
        fail(f"expected a JSON object (a report of glm5-hal conformance --json), got {_kind(data)}")
    if "meta" not in data or "records" not in data:
        fail("not a conformance report (no 'meta' and 'records')")
    meta, records = data["meta"], data["records"]
    if not isinstance(meta, dict):
        fail(f"meta: expected an object, got {_kind(meta)}")
    schema = meta.get("schema", 1)
    if type(schema) is not int or schema not in RUN_SCHEMAS:
        fail(f"report schema {schema!r} is not one this glm5_hal reads ({_listed(RUN_SCHEMAS)}); "
             "was it written by a newer glm5_hal?")
    _check_fields(meta, _META, "meta", fail)
    for name, facts in meta.get("backends", {}).items():
        if not isinstance(facts, dict):
            fail(f"meta.backends.{name}: expected an object, got {_kind(facts)}")
        _check_fields(facts, {"device_name": str, "versions": dict, "reason": str}, f"meta.backends.{name}", fail)
    _check_machine(meta.get("machine", {}), "meta.machine", fail)
    _check_strings(meta.get("presets", []), "meta.presets", fail)
    _check_strings(meta.get("argv", []), "meta.argv", fail)
    if not isinstance(records, list):
        fail(f"records: expected a list, got {_kind(records)}")
    for i, record in enumerate(records):
        _check_record(record, f"record {i}", fail)


def check_matrix(data, source: str) -> None:
    """Refuses `data` unless it is a merged matrix of a known schema: columns with their keys,
    and per column every case's [status, margin] with a known status."""
    fail = _failer(source)
    if not isinstance(data, dict):
        fail(f"expected a JSON object (a merged matrix), got {_kind(data)}")
    schema = data.get("schema")
    if type(schema) is not int or schema not in MATRIX_SCHEMAS:
        fail(f"matrix schema {schema!r} is not one this glm5_hal reads ({_listed(MATRIX_SCHEMAS)}); "
             "was it written by a newer glm5_hal?")
    for field, kind in (("columns", list), ("records", dict)):
        if not isinstance(data.get(field), kind):
            fail(f"{field}: expected {'a list' if kind is list else 'an object'}, got {_kind(data.get(field))}")
    keys = set()
    for i, column in enumerate(data["columns"]):
        if not isinstance(column, dict) or not isinstance(column.get("key"), str):
            fail(f"columns[{i}]: expected an object with a string 'key', got {_kind(column)}")
        _check_fields(column, _COLUMN, f"column {column['key']!r}", fail)
        _check_machine(column.get("machine", {}), f"column {column['key']!r} machine", fail)
        keys.add(column["key"])
    for key, cases in data["records"].items():
        if key not in keys:
            fail(f"records: column {key!r} is not among the matrix's columns")
        if not isinstance(cases, dict):
            fail(f"records[{key!r}]: expected an object (case -> [status, margin]), got {_kind(cases)}")
        for case, value in cases.items():
            if not (isinstance(value, list) and len(value) == 2):
                fail(f"records[{key!r}][{case!r}]: expected [status, margin], got {_short(value)}")
            _check_status(value[0], f"records[{key!r}][{case!r}]", fail)
            if not isinstance(value[1], _MEASURE):
                fail(f"records[{key!r}][{case!r}]: margin must be a number, a string or null, got {_kind(value[1])}")


def _check_record(record, where: str, fail) -> None:
    if not isinstance(record, dict):
        fail(f"{where}: expected an object, got {_kind(record)}")
    case = record.get("case")
    if isinstance(case, str):
        where = f"{where} ({case})"
    missing = [f for f in _RECORD_REQUIRED if f not in record]
    if missing:
        fail(f"{where}: lacks {', '.join(repr(f) for f in missing)}")
    for field in _RECORD_REQUIRED:
        if not isinstance(record[field], str):
            fail(f"{where}: {field} must be a string, got {_kind(record[field])}")
    _check_status(record["status"], where, fail)
    if len(case.split("/")) < 2 or not case.startswith(record["op"] + "/"):
        fail(f"{where}: case id must be '<op>/<preset>/...' for op {record['op']!r}")
    _check_fields(record, _RECORD_OPTIONAL, where, fail)
    for j, output in enumerate(record.get("outputs", [])):
        if not isinstance(output, dict):
            fail(f"{where}: outputs[{j}]: expected an object, got {_kind(output)}")


def _check_status(status, where: str, fail) -> None:
    if status not in STATUSES:
        fail(f"{where}: status {_short(status)} is not one of {', '.join(STATUSES)}")


def _check_fields(obj: dict, types: dict, where: str, fail) -> None:
    for field, kind in types.items():
        if field not in obj:
            continue
        value = obj[field]
        # JSON true/false are Python bools, which are ints: never a number here
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            fail(f"{where}: {field} must be {_describe(kind)}, got {_kind(value)}")


def _check_machine(machine, where: str, fail) -> None:
    if not isinstance(machine, dict):
        fail(f"{where}: expected an object, got {_kind(machine)}")
    accelerators = machine.get("accelerators", [])
    if not isinstance(accelerators, list) or not all(
            isinstance(a, dict) and "count" in a and "type" in a for a in accelerators):
        fail(f"{where}: accelerators must be a list of objects with 'count' and 'type'")


def _check_strings(values, where: str, fail) -> None:
    if not all(isinstance(v, str) for v in values):
        fail(f"{where}: expected a list of strings")


def _failer(source: str):
    def fail(what: str):
        raise ReportShapeError(f"conformance: {source}: {what}")
    return fail


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _as_tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _describe(kind) -> str:
    kinds = _as_tuple(kind)
    words = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
             type(None): "null"}
    named = list(dict.fromkeys(words[k] for k in kinds))
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _listed(values) -> str:
    return ", ".join(map(str, values))
