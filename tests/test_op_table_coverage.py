"""Every op of the op table (glm5_hal.opdef.OPS, not a hand-written family list) has
conformance cases: results on both presets and, on the tiny preset, expected errors. An op
added without cases fails here by name."""
from __future__ import annotations

import pytest

import glm5_hal.ops  # noqa: F401  (defines the ops)
from glm5_hal.conformance.case import ERROR, PRESETS, RESULT
from glm5_hal.conformance.cases import cases
from glm5_hal.opdef import OPS


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(OPS))
def test_every_op_has_conformance_cases(name, preset):
    outcomes = {case.outcome for case in cases(name, preset)}
    assert RESULT in outcomes, f"{name} has no {preset} conformance case expecting a result"
    if preset == "tiny":
        assert ERROR in outcomes, f"{name} has no tiny conformance case expecting InvalidInputError"
