"""The conformance suite: every backend's numbers judged against the reference.

Run it with `glm5-hal conformance [--backend B]` or
`pytest --pyargs glm5_hal.conformance --glm5-backend B -n auto` (docs/conformance.md).

Modules: `case` (Case, View, input helpers), `cases/` (one generator module per op
family), `tolerance` (the per-dtype base table and widening), `transforms` (dequantize
before comparing), `compare` (the rules Close, Exact, TopKSet), `suite` (which items a run
has), `runner` (run one case for one backend -> Record), `record`, `report` (JSON, JUnit,
Markdown, terminal matrix), `machine` (where a report was made), `matrix` (many reports
merged: `glm5-hal conformance merge`), `html` (the merged matrix as one page), `diff` (what
got worse: `glm5-hal conformance diff`), `progress`, `pytest_plugin`.

Attributes load on first access: the pytest plugin imports this package in every pytest
session of an environment where glm5_hal is installed, and must not import torch there.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Case": "case", "View": "case", "RESULT": "case", "ERROR": "case", "RESULT_OR_ERROR": "case",
    "PRESETS": "case", "randn": "case", "uniform": "case",
    "Close": "compare", "Exact": "compare", "TopKSet": "compare", "Verdict": "compare",
    "Tolerance": "tolerance", "tolerance": "tolerance",
    "Fp8Dequant": "transforms", "Int4Dequant": "transforms", "Fp8Codes": "transforms",
    "generator": "cases",
    "Record": "record", "STATUSES": "record",
    "Item": "suite", "plan": "suite",
    "run_case": "runner", "run_item": "runner", "run_all": "runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'glm5_hal.conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
