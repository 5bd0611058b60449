"""Expected-error cases (outcome ERROR): every op with cases has them, each names the argument
its InvalidInputError must name, the cpu backend passes them, and an op whose input checks
are skipped fails every one of them."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_python
from glm5_hal.conformance import runner
from glm5_hal.conformance.case import ERROR, Case
from glm5_hal.conformance.cases import cases, ops_with_cases

# the ops whose expected-error cases name their argument (issue 15)
NAMED = ["rms_norm", "silu_and_mul", "apply_rope", "hadamard_transform", "sparse_mla_attention", "moe_permute"]


def error_cases(op: str) -> list[Case]:
    return [c for c in cases(op, "tiny") if c.outcome == ERROR]


@pytest.mark.parametrize("op", ops_with_cases())
def test_every_op_has_expected_error_cases(op):
    assert error_cases(op), f"{op} has no expected-error case"


@pytest.mark.parametrize("op", NAMED)
def test_the_cpu_backend_rejects_each_naming_the_argument(op):
    found = error_cases(op)
    assert len(found) >= 6 and all(c.error_arg for c in found)
    for case in found:
        record = runner.run_case("cpu", case)
        assert record.status == "pass", (case.id, record.reason)
        assert f"{op}: argument '{case.error_arg}': expected" in record.reason, (case.id, record.reason)


def test_an_error_naming_another_argument_fails_the_case():
    [case] = [c for c in error_cases("rms_norm") if c.name == "weight_length_differs" and c.dtype == torch.float32]
    wrong = Case(case.op, case.preset, case.name, case.dtype, case.inputs, outcome=ERROR, error_arg="x")
    record = runner.run_case("cpu", wrong)
    assert record.status == "fail"
    assert record.reason.startswith("raised InvalidInputError naming 'weight', expected 'x'")
    with pytest.raises(ValueError, match="error_arg is for cases whose outcome is ERROR"):
        Case("rms_norm", "tiny", "x", torch.float32, case.inputs, {"out": object()}, error_arg="x")


# A fresh process: defines test-only copies of the ops without their input checks, as a
# dispatch that skipped them would run, and runs each expected-error case on them.
UNCHECKED = '''
import dataclasses, json
import glm5_hal as hal
import glm5_hal.ops
from glm5_hal.contract import Unchecked
from glm5_hal.opdef import define, lookup
from glm5_hal.conformance import runner
from glm5_hal.conformance.cases import cases
ops = {ops!r}
for op in ops:
    o = lookup(op)
    define(o.reference, name="unchecked_" + op, args={{p: Unchecked() for p in o.params}}, fake=o.fake,
           mutates=o.mutates)
hal.reload()
out = {{}}
for op in ops:
    for case in cases(op, "tiny"):
        if case.outcome == "error":
            record = runner.run_case("reference", dataclasses.replace(case, op="unchecked_" + op))
            out[case.id] = [record.status, record.reason[:300]]
print(json.dumps(out))
'''


@pytest.mark.slow
def test_ops_without_their_input_checks_fail_every_expected_error_case():
    proc = run_python(UNCHECKED.format(ops=NAMED))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {c.id for op in NAMED for c in error_cases(op)}
    passed = {case: reason for case, (status, reason) in out.items() if status == "pass"}
    assert not passed, passed
    returned = [case for case, (status, reason) in out.items()
                if status == "fail" and "returned, but the contract requires InvalidInputError" in reason]
    assert returned   # most compute something; the rest crash (status error), never pass
