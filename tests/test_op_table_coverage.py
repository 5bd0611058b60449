"""Every op of the op table (glm5_hal.opdef.OPS, not a hand-written family list) has
conformance cases: results on both presets and, on the tiny preset, expected errors. An op
added without cases fails here by name (shown with an op defined only for the test)."""
from __future__ import annotations

import itertools

import pytest
import torch

import glm5_hal.ops  # noqa: F401  (defines the ops)
from glm5_hal.conformance.case import ERROR, PRESETS, RESULT
from glm5_hal.conformance.cases import cases
from glm5_hal.contract import Tensor
from glm5_hal.opdef import OPS, define


def missing_cases(name: str, preset: str) -> list[str]:
    """What the op lacks on `preset`: a case expecting a result, and (tiny) one expecting
    InvalidInputError."""
    outcomes = {case.outcome for case in cases(name, preset)}
    missing = [] if RESULT in outcomes else [f"{name} has no {preset} conformance case expecting a result"]
    if preset == "tiny" and ERROR not in outcomes:
        missing.append(f"{name} has no tiny conformance case expecting InvalidInputError")
    return missing


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(OPS))
def test_every_op_has_conformance_cases(name, preset):
    assert not missing_cases(name, preset)


_PROBE_RUNS = itertools.count()


def coverage_probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_an_op_without_cases_is_reported_by_name():
    # an op defined here, with no conformance generator: the table-derived check names it
    # a fresh name each run: the torch custom op of an earlier run stays defined in the process
    name = f"coverage_probe_without_cases_{next(_PROBE_RUNS)}"
    define(coverage_probe, args=dict(x=Tensor("N", (torch.float32,))), fake=lambda x: torch.empty_like(x),
           name=name)
    try:
        for preset in PRESETS:
            assert f"{name} has no {preset} conformance case expecting a result" in missing_cases(name, preset)
        assert f"{name} has no tiny conformance case expecting InvalidInputError" in missing_cases(name, "tiny")
        assert missing_cases("moe_unpermute", "tiny") == []
    finally:
        del OPS[name]   # the op table is as before
