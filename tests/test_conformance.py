"""The conformance suite itself: it passes the cpu backend, catches deliberately wrong
backends, applies each rule as specified, and its entry points and reports work."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import types
import xml.etree.ElementTree as ET

import pytest
import torch

import glm5_hal as hal
from conftest import REPO, run_python, write_dist
from conformance_reports import WRONG_VENDOR, wrong_vendor_plugin
from glm5_hal.conformance import report, runner, suite
from glm5_hal.conformance.case import ERROR, RESULT, RESULT_OR_ERROR, Case, View
from glm5_hal.conformance.compare import Close, Exact, close, exact, topk_set
from glm5_hal.conformance.record import Record
from glm5_hal.conformance.tolerance import tolerance
from glm5_hal.conformance.transforms import Fp8Dequant, Int4Dequant


def as_plugin(backend) -> types.ModuleType:
    module = types.ModuleType(f"plugin_{backend.name}")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def make_backend(name, rms_norm=None, *, dtypes=None, supports=None, available=True,
                 reason="test backend", caps=None):
    class _B(hal.Backend):
        device_type, priority = "cpu", -1

        def probe(self):
            return hal.Availability(available, reason)

        def capabilities(self):
            return caps or hal.Capabilities()

    _B.name = name
    backend = _B()
    if rms_norm is not None:
        backend.impl("rms_norm", dtypes=dtypes, supports=supports)(rms_norm)
    return backend


def good_rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def run(hal_state, backend, presets=("tiny",)) -> dict[str, Record]:
    hal_state(as_plugin(backend), backend.name)
    items = suite.plan([backend.name], ["rms_norm"], list(presets))
    return {r.case: r for r in runner.run_all(items)}


def with_status(records: dict[str, Record], *statuses) -> set[str]:
    return {case for case, r in records.items() if r.status in statuses}


def names(cases) -> set[str]:
    return {c.split("/")[2] for c in cases}


# rms_norm's expected-error cases: the op's checks reject them before any backend runs, so
# every backend that takes rms_norm passes them
RMS_ERRORS = {"weight_length_differs", "zero_width", "negative_eps"}


def errors_of(records) -> set[str]:
    return {c for c in records if names([c]) <= RMS_ERRORS}


# -- the cpu backend and deliberately wrong backends ------------------------------------------
def test_cpu_backend_passes_every_case():
    items = suite.plan(["cpu"], ["rms_norm"], ["tiny", "glm5"])
    records = runner.run_all(items)
    assert len(records) == 3 * (13 + len(RMS_ERRORS) + 4)
    assert {r.status for r in records} == {"pass"}, report.format_matrix(records)
    results = [r for r in records if names([r.case]) - RMS_ERRORS]
    assert {r.impl for r in results} == {"cpu.rms_norm"}
    assert all(0 <= r.margin <= 1 for r in results)
    assert {(r.impl, r.margin) for r in records if r not in results} == {("", None)}


def test_eps_outside_the_sqrt_is_caught(hal_state):
    def eps_outside(x, weight, eps):
        xf = x.float()
        return (xf / (xf.square().mean(-1, keepdim=True).sqrt() + eps) * weight.float()).to(x.dtype)
    records = run(hal_state, make_backend("epsout", eps_outside))
    failing = with_status(records, "fail")
    small = {f"rms_norm/tiny/small_magnitude/{d}" for d in ("float32", "float16", "bfloat16")}
    assert small <= failing and all(records[c].margin > 10 for c in small)
    # half outputs: the error hides below their rounding except where mean(x^2) ~ eps
    assert not {c for c in failing if not c.endswith("float32")} - small
    assert with_status(records, "pass", "fail") == set(records)


def test_one_ulp_bias_is_caught_in_half_precision(hal_state):
    def biased(x, weight, eps):
        return good_rms_norm(x, weight, eps) + torch.finfo(x.dtype).eps
    records = run(hal_state, make_backend("biased", biased), presets=("tiny", "glm5"))
    failing = with_status(records, "fail")
    # float32: 1.2e-7 is far below atol 1e-5, by design. Half precision: caught wherever an
    # output is near zero; a single element near +-1 (rows1_dim1) stays within 2 ulps.
    expected = {c for c in records if not c.endswith("float32")
                and names([c]) & {"rows1_dim1", "empty_batch", *RMS_ERRORS} == set()}
    assert failing == expected
    worst = records["rms_norm/tiny/zero_rows/bfloat16"]
    assert worst.worst["ref"] == 0 and worst.worst["out"] == pytest.approx(2 ** -7)
    assert "elements outside |out - ref| <= atol + rtol*|ref|" in worst.reason


def test_miscomputed_non_contiguous_input_is_caught(hal_state):
    def ignores_strides(x, weight, eps):
        dense = torch.as_strided(x, x.shape, torch.empty(x.shape).stride())
        return good_rms_norm(dense, weight, eps)
    records = run(hal_state, make_backend("strideless", ignores_strides), presets=("tiny", "glm5"))
    assert names(with_status(records, "fail")) == {
        "noncontig_transposed", "noncontig_strided", "noncontig_row_slice", "kv_lora512_of_576"}
    assert len(with_status(records, "fail")) == 12
    assert with_status(records, "pass", "fail") == set(records)


def test_rejecting_non_contiguous_input_is_accepted(hal_state):
    def contiguous_only(x, weight, eps):
        if not x.is_contiguous():
            raise hal.InvalidInputError("rms_norm", "x", "a contiguous tensor", "strided", "picky")
        return good_rms_norm(x, weight, eps)
    records = run(hal_state, make_backend("picky", contiguous_only))
    assert with_status(records, "pass") == set(records)
    rejected = {c for c, r in records.items() if r.reason.startswith("rejected with InvalidInputError")}
    assert names(rejected) - RMS_ERRORS == {"noncontig_transposed", "noncontig_strided", "noncontig_row_slice"}


def test_invalid_input_error_on_a_valid_input_is_an_error(hal_state):
    def refuses_3d(x, weight, eps):
        if x.dim() != 2:
            raise hal.InvalidInputError("rms_norm", "x", "a 2-d tensor", "3-d", "flat")
        return good_rms_norm(x, weight, eps)
    records = run(hal_state, make_backend("flat", refuses_3d))
    assert names(with_status(records, "error")) == {"batch2x3_dim33"}
    assert "raised InvalidInputError on a valid input" in records["rms_norm/tiny/batch2x3_dim33/float32"].reason


def test_a_raising_backend_yields_errors_with_the_exception_text(hal_state):
    def crashes(x, weight, eps):
        raise RuntimeError("device kernel crashed")
    records = run(hal_state, make_backend("crashy", crashes))
    assert with_status(records, "error") == set(records) - errors_of(records)
    assert with_status(records, "pass") == errors_of(records)
    assert all(r.reason == "RuntimeError: device kernel crashed" for c, r in records.items()
               if c not in errors_of(records))


def test_declining_via_supports_is_a_fallback_not_a_pass(hal_state):
    backend = make_backend("twod", good_rms_norm, supports=lambda x, w, eps: x.dim() == 2 or "2-d x only")
    records = run(hal_state, backend)
    fallback = with_status(records, "fallback")
    assert names(fallback) == {"batch2x3_dim33"} and len(fallback) == 3
    assert all(records[c].reason == "2-d x only" and records[c].impl == "reference.rms_norm" for c in fallback)
    assert with_status(records, "pass") == set(records) - fallback


def test_undeclared_dtype_is_a_fallback_and_excluded_dtype_a_skip(hal_state):
    caps = hal.Capabilities(dtypes=frozenset({torch.float32, torch.float16}), device_name="Chip9")
    records = run(hal_state, make_backend("fp32only", good_rms_norm, dtypes=(torch.float32,), caps=caps))
    statuses = {d: {r.status for c, r in records.items() if c.endswith("/" + d)} for d in ("float32", "float16", "bfloat16")}
    assert statuses == {"float32": {"pass"}, "float16": {"fallback"}, "bfloat16": {"skip"}}
    assert records["rms_norm/tiny/rows3_dim17/float16"].reason == "implements rms_norm for {float32}, not float16"
    assert records["rms_norm/tiny/rows3_dim17/bfloat16"].reason == "device Chip9 does not support bfloat16"


def test_a_backend_without_the_op_falls_back_everywhere(hal_state):
    records = run(hal_state, make_backend("noops"))
    assert with_status(records, "fallback") == set(records)
    assert {r.reason for r in records.values()} == {"does not implement rms_norm"}


def test_modifying_an_input_is_caught(hal_state):
    def in_place(x, weight, eps):
        return x.copy_(good_rms_norm(x, weight, eps))
    records = run(hal_state, make_backend("clobber", in_place))
    bad = {c for c, r in records.items() if "modified its input(s) ['x']" in r.reason}
    assert bad and bad == with_status(records, "fail") - {c for c in records if "empty_batch" in c}


def test_unavailable_backend_yields_one_skip_per_op_with_the_probe_reason(hal_state):
    hal_state(as_plugin(make_backend("offline", good_rms_norm, available=False, reason="no NPU found")), "offline")
    assert "offline" not in suite.resolve_backends(None)
    records = runner.run_all(suite.plan(["offline"], ["rms_norm"], ["tiny", "glm5"]))
    assert [(r.case, r.status, r.reason) for r in records] == [
        ("rms_norm/*", "skip", "backend unavailable: no NPU found")]


def test_quarantined_plugin_yields_errors_and_unknown_names_are_refused(hal_state):
    def broken(register):
        raise RuntimeError("bridge import failed")
    module = types.ModuleType("broken")
    module.glm5_hal_register_backends = hal.hookimpl(broken)
    hal_state(module, "brokenvendor")
    [record] = runner.run_all(suite.plan(["brokenvendor"], ["rms_norm"], ["tiny"]))
    assert record.status == "error" and "bridge import failed" in record.reason
    with pytest.raises(hal.HalError, match="unknown backend"):
        suite.resolve_backends(["nosuch"])
    with pytest.raises(hal.HalError, match="unknown op"):
        suite.resolve_ops(["nosuch"])
    with pytest.raises(hal.HalError, match="long.*benchmarks only"):
        suite.resolve_presets(["long"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_cuda_reference_is_refused_without_cuda():
    with pytest.raises(hal.HalError, match="--ref cuda needs a CUDA device"):
        runner.check_reference_mode("cuda")
    with pytest.raises(hal.HalError, match="reference mode must be one of"):
        runner.run_all([], "gpu")


# -- cases and the expected-error outcome --------------------------------------------------
def test_case_ids_are_stable_and_inputs_deterministic():
    from glm5_hal.conformance.cases import cases
    tiny = cases("rms_norm", "tiny")
    assert len({c.id for c in tiny}) == len(tiny) == 39 + 3 * len(RMS_ERRORS)
    c = next(c for c in tiny if c.id == "rms_norm/tiny/rows3_dim17/bfloat16")
    x1, w1, _ = c.make_inputs()
    x2, w2, _ = c.make_inputs()
    assert torch.equal(x1, x2) and torch.equal(w1, w2) and x1.dtype == torch.bfloat16
    other = next(c for c in tiny if c.id == "rms_norm/tiny/rows3_dim17/float16")
    assert not torch.equal(other.make_inputs()[0].float(), x1.float())
    view = next(c for c in tiny if c.id == "rms_norm/tiny/noncontig_strided/float32").make_inputs()[0]
    assert isinstance(view, View) and not view.on(view.base).is_contiguous()
    with pytest.raises(ValueError, match="preset"):
        Case("rms_norm", "long", "x", torch.float32, lambda g: (), {"out": Close()})
    with pytest.raises(ValueError, match="needs at least one check"):
        Case("rms_norm", "tiny", "x", torch.float32, lambda g: ())


def rms_case(name, x, w, outcome=RESULT, checks=None):
    return Case("rms_norm", "tiny", name, x.dtype, lambda g: (x, w, 1e-5),
                {"out": Close()} if checks is None else checks, outcome=outcome)


def test_expected_error_passes_iff_invalid_input_error_is_raised():
    bad = rms_case("weight_too_short", torch.randn(3, 8), torch.randn(7), ERROR, {})
    r = runner.run_case("cpu", bad)
    assert r.status == "pass" and "rejected with InvalidInputError" in r.reason and "weight" in r.reason
    good = rms_case("valid", torch.randn(3, 8), torch.randn(8), ERROR, {})
    r = runner.run_case("cpu", good)
    assert r.status == "fail" and "contract requires InvalidInputError" in r.reason
    # the same rejection where a result is required is an error, not a pass
    r = runner.run_case("cpu", rms_case("weight_too_short", torch.randn(3, 8), torch.randn(7)))
    assert r.status == "error" and "on a valid input" in r.reason


def test_case_definition_errors_are_reported_as_errors():
    r = runner.run_case("cpu", rms_case("bad_target", torch.randn(2, 4), torch.randn(4), checks={"nope": Close()}))
    assert r.status == "error" and "target 'nope'" in r.reason
    r = runner.run_case("cpu", rms_case("wrong_dtype", torch.randn(2, 4), torch.randn(4),
                                        checks={"out": Close(dtype=torch.bfloat16)}))
    assert r.status == "fail" and "dtype float32, expected bfloat16" in r.reason


INPLACE = '''
import json, types, torch
import glm5_hal as hal
from glm5_hal import checks as C
from glm5_hal.opdef import define
from glm5_hal.contract import Tensor
from glm5_hal.conformance import runner
from glm5_hal.conformance.case import ERROR, RESULT, RESULT_OR_ERROR, Case
from glm5_hal.conformance.compare import Exact

def fill_rows(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    cache[slots.long()] = values.to(cache.dtype)

def check_values(cache, values, slots):
    C.index_range("fill_rows", "slots", slots, 0, cache.shape[0])

define(fill_rows, args=dict(cache=Tensor("R, D"), values=Tensor("*, *"), slots=Tensor("*")),
       check_values=check_values, fake=lambda cache, values, slots: None, mutates=("cache",))

class B(hal.Backend):
    device_type, priority = "cpu", -1
def backend(name, fn):
    b = type(name, (B,), {"name": name})()
    b.impl("fill_rows")(fn)
    m = types.ModuleType(name)
    m.glm5_hal_register_backends = hal.hookimpl(lambda register: register(b))
    hal.load_plugin(m, name)

def good(cache, values, slots):
    cache[slots.long()] = values
def leaky(cache, values, slots):
    good(cache, values, slots); cache[0] = 7
def writes_then_rejects(cache, values, slots):
    good(cache, values, slots)
    raise hal.InvalidInputError("fill_rows", "slots", "sorted slots", "unsorted", "half")
backend("good", good); backend("leaky", leaky); backend("half", writes_then_rejects)

def case(name, slots, outcome=RESULT, checks=None):
    return Case("fill_rows", "tiny", name, torch.bfloat16,
                lambda g: (torch.zeros(6, 4, dtype=torch.bfloat16),
                           torch.randn(len(slots), 4, generator=g).bfloat16(), torch.tensor(slots, dtype=torch.int32)),
                {"cache": Exact()} if checks is None else checks, outcome=outcome)

out = {}
for b in ("good", "leaky", "half"):
    for c in (case("write", [4, 1, 5]), case("bad_slot", [1, 9], ERROR), case("maybe", [2, 3], RESULT_OR_ERROR),
              case("unchecked", [2], checks={"out": Exact()})):
        r = runner.run_case(b, c)
        out[f"{b}:{c.name}"] = [r.status, r.reason]
print(json.dumps(out))
'''


def test_in_place_ops_compare_the_whole_destination_and_errors_leave_it_untouched():
    proc = run_python(INPLACE)   # a fresh process: defines a test-only in-place op
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["good:write"][0] == "pass" and out["good:maybe"][0] == "pass"
    assert out["good:bad_slot"][0] == "pass" and "values in [0, 6)" in out["good:bad_slot"][1]
    assert out["leaky:write"][0] == "fail" and "cache: " in out["leaky:write"][1]
    assert "first at [0, 0]: out=7.0, ref=0.0" in out["leaky:write"][1]
    assert out["half:maybe"][0] == "fail" and "modified ['cache']" in out["half:maybe"][1]
    assert out["half:write"][0] == "error"
    assert out["good:unchecked"][0] == "error" and "['cache'] are not checked" in out["good:unchecked"][1]


# -- the rules on hand-built examples ------------------------------------------------------------
INF = float("inf")


def test_close_rule_bound_margin_and_worst_element():
    tol = tolerance(torch.float16)
    want = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    got = want + torch.tensor([5e-4, 0.0, 2e-6])
    v = close(got, want, tol)
    assert v.ok and v.margin == pytest.approx(5e-4 / (1e-5 + 1e-3)) and v.worst["index"] == [0]
    assert v.max_abs == pytest.approx(5e-4) and v.max_rel == pytest.approx(5e-4)
    v = close(want + torch.tensor([0.0, 0.0, 2e-5]), want, tol)
    assert not v.ok and v.margin == pytest.approx(2.0) and v.worst["index"] == [2]
    assert "1 of 3 elements outside" in v.message and "margin 2" in v.message


def test_close_rule_non_finite_values_must_match_exactly():
    tol = tolerance(torch.float32)
    lse = torch.tensor([[0.5, -INF], [float("nan"), INF]], dtype=torch.float64)
    assert close(lse.clone(), lse, tol).ok
    for position, value in (((0, 1), 0.0), ((0, 1), INF), ((1, 0), INF), ((1, 1), -INF), ((0, 0), INF)):
        got = lse.clone()
        got[position] = value
        v = close(got, lse, tol)
        assert not v.ok and "non-finite values differ at 1 of 4" in v.message, (position, value)
        assert v.worst["index"] == list(position)


def test_widening_needs_a_one_line_justification():
    with pytest.raises(ValueError, match="justification"):
        Close(widen=2)
    with pytest.raises(ValueError, match=">= 1"):
        Close(widen=0.5, why="tighter")
    t = Close(widen=4, why="sum of K terms").widen
    assert tolerance(torch.bfloat16, t, "sum of K terms").rtol == pytest.approx(4 * 1.6e-2)
    assert "x4: sum of K terms" in tolerance(torch.float32, 4, "sum of K terms").describe()


def test_exact_rule():
    a = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert exact(a, a.clone()).ok
    v = exact(torch.tensor([1, 5, 3], dtype=torch.int32), a)
    assert not v.ok and "1 of 3 elements differ" in v.message and v.worst["index"] == [1]
    f = torch.tensor([float("nan"), 1.5])
    assert exact(f, f.double()).ok
    assert not exact(torch.tensor([1.5, 1.0]), torch.tensor([1.5, 1.0 + 2 ** -40], dtype=torch.float64)).ok


def test_dequantizing_transforms():
    q = torch.tensor([[1.0, -2.0, 4.0, 0.5]]).to(torch.float8_e4m3fn)
    scales = {"out[1]": torch.tensor([[2.0, 0.25]])}
    values, unit = Fp8Dequant("out[1]")(q, scales.__getitem__)
    assert values.tolist() == [[2.0, -4.0, 1.0, 0.125]] and unit.tolist() == [[2.0, 2.0, 0.25, 0.25]]
    per_row = Fp8Dequant("k_scale")(q.reshape(1, 1, 4), {"k_scale": torch.tensor([[3.0]])}.__getitem__)[0]
    assert per_row.flatten().tolist() == [3.0, -6.0, 12.0, 1.5]
    # int4: elements 0..7 = q + 8 in nibbles 0..7 of one int32
    q4 = torch.tensor([-7, -1, 0, 1, 7, 3, -3, 2])
    word = sum(int(u) << (4 * i) for i, u in enumerate(q4 + 8))
    packed = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    values, _ = Int4Dequant("out[1]", 4)(packed, {"out[1]": torch.tensor([[0.5, 2.0]])}.__getitem__)
    assert values.tolist() == [[-3.5, -0.5, 0.0, 0.5, 14.0, 6.0, -6.0, 4.0]]
    with pytest.raises(ValueError, match="do not block"):
        Fp8Dequant("s")(q, {"s": torch.ones(1, 3)}.__getitem__)


def test_fp8_outputs_compare_scale_relative_after_dequantization():
    tol = tolerance(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale-relative"):
        tol.bound(torch.ones(1))
    x = torch.tensor([[0.0, 3.0]], dtype=torch.float64)
    unit = torch.tensor([[4.0, 4.0]], dtype=torch.float64)
    assert close(x + torch.tensor([[4 * 2 ** -9, 0.0]]), x, tol, unit).ok
    assert not close(x + torch.tensor([[4 * 2 ** -8, 0.0]]), x, tol, unit).ok


TAU = tolerance(torch.bfloat16)   # score slack: 1e-5 + 1.6e-2 * |k-th score|
SCORES = torch.tensor([[5.0, 4.0, 3.0, 2.98, 1.0, -INF],      # 5 keys in range
                       [1.0, 2.0, -INF, -INF, -INF, -INF]],   # 2 keys in range
                      dtype=torch.float64)


def topk(rows):
    return topk_set(torch.tensor(rows, dtype=torch.int32), SCORES, TAU)


def test_topk_set_rule_accepts_any_order_and_swaps_within_tau():
    v = topk([[2, 0, 1], [1, 0, -1]])
    assert v.ok and v.swaps == 0 and v.margin == 0
    v = topk([[0, 3, 1], [0, 1, -1]])   # 2.98 instead of 3.0: within 1e-5 + 1.6e-2 * 3
    assert v.ok and v.swaps == 1 and 0 < v.margin < 1


@pytest.mark.parametrize("rows,problem", [
    ([[0, 0, 1], [0, 1, -1]], "duplicate indices"),
    ([[0, 1, 2], [0, 2, -1]], "a selected key outside the row's range"),
    ([[0, 1, 2], [-1, 0, 1]], "a valid entry after a -1"),
    ([[0, 1, 2], [0, -1, -1]], "wrong count of valid entries"),
    ([[0, 1, -1], [0, 1, -1]], "wrong count of valid entries"),
    ([[0, 1, 6], [0, 1, -1]], "an index >= 6 keys"),
    ([[0, 1, 5], [0, 1, -1]], "a selected key outside the row's range"),
    ([[0, 1, -2], [0, 1, -1]], "entries below -1"),
])
def test_topk_set_rule_structural_failures(rows, problem):
    v = topk(rows)
    assert not v.ok and problem in v.message


def test_topk_set_rule_rejects_a_clearly_too_low_score():
    v = topk([[0, 1, 4], [0, 1, -1]])
    assert not v.ok and "more than tau below" in v.message and v.worst["key"] == 4
    assert v.margin > 1 and v.swaps == 1


# -- reports ---------------------------------------------------------------------------------
def mixed_records() -> list[Record]:
    base = dict(device="cpu", op="rms_norm", preset="tiny", dtype="float32")
    return [Record("a", case="rms_norm/tiny/x/float32", status="pass", margin=0.2, **base),
            Record("a", case="rms_norm/tiny/y/float32", status="fail", reason="1 of 3 elements outside",
                   margin=3.0, max_abs=float("inf"), **base),
            Record("a", case="rms_norm/tiny/z/float32", status="error", reason="RuntimeError: boom", **base),
            Record("b", case="rms_norm/tiny/x/float32", status="fallback", reason="does not implement rms_norm", **base),
            Record("c", case="rms_norm/*", status="skip", reason="backend unavailable: no NPU | found",
                   **dict(base, preset="", dtype="", device=""))]


META = {"timestamp": "2025-01-01T00:00:00+00:00", "glm5_hal": "0.1.0", "torch": "2.x",
        "reference": {"mode": "cpu", "dtype": "float64"}, "presets": ["tiny"],
        "backends": {"a": {"device_name": "Chip", "versions": {"sdk": "1"}}}}


def test_json_report_fields(tmp_path):
    meta = report.metadata(["cpu"], ["rms_norm"], ["tiny"], "cpu", 1)
    assert {"timestamp", "torch", "glm5_hal", "reference", "backends", "presets", "ops",
            "ops_without_cases", "platform", "workers"} <= set(meta)
    assert meta["backends"]["cpu"]["versions"]["torch"] == torch.__version__
    report.write_json(tmp_path / "r" / "c.json", mixed_records(), meta)
    data = json.loads((tmp_path / "r" / "c.json").read_text())
    assert data["summary"] == {"pass": 1, "fail": 1, "error": 1, "fallback": 1, "skip": 1}
    required = {"backend", "device", "op", "case", "dtype", "status", "max_abs", "max_rel", "atol",
                "rtol", "margin", "swaps", "duration_ms", "reason", "impl", "worst", "outputs"}
    assert all(required <= set(r) for r in data["records"])
    assert data["records"][1]["max_abs"] == "inf"   # strict JSON: no Infinity


def test_junit_report_parses_and_counts(tmp_path):
    report.write_junit(tmp_path / "c.xml", mixed_records(), META)
    root = ET.parse(tmp_path / "c.xml").getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    a = suites["glm5_hal.conformance[a]"]
    assert (a.get("tests"), a.get("failures"), a.get("errors"), a.get("skipped")) == ("3", "1", "1", "0")
    assert suites["glm5_hal.conformance[b]"].get("skipped") == "1"
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert cases[("glm5_hal.conformance.a.rms_norm", "rms_norm/tiny/y/float32")].find("failure") is not None
    assert cases[("glm5_hal.conformance.a.rms_norm", "rms_norm/tiny/z/float32")].find("error").get("message") == "RuntimeError: boom"
    fb = cases[("glm5_hal.conformance.b.rms_norm", "rms_norm/tiny/x/float32")].find("skipped")
    assert fb.get("message") == "fallback: does not implement rms_norm"
    assert cases[("glm5_hal.conformance.c.rms_norm", "rms_norm/*")].find("skipped") is not None
    assert cases[("glm5_hal.conformance.a.rms_norm", "rms_norm/tiny/x/float32")].find("*") is None


def test_markdown_and_terminal_matrix():
    md = report.to_markdown(mixed_records(), META)
    assert "| op | `a` | `b` | `c` |" in md
    assert "| `rms_norm` | ❌ 1 pass, 1 fail, 1 error | ⚠️ 1 fallback | ⏭️ 1 skip |" in md
    assert "no NPU \\| found" in md   # table cells escape pipes
    text = report.format_matrix(mixed_records())
    assert text.splitlines()[0].split() == ["op", "a", "b", "c"]
    assert "total: 1 pass, 1 fail, 1 error, 1 fallback, 1 skip" in text
    assert "FAIL     a rms_norm/tiny/y/float32: 1 of 3 elements outside" in text
    assert report.failed(mixed_records()) and not report.failed(mixed_records()[3:])


@pytest.mark.slow
def test_parallel_workers_give_the_same_records():
    choices = (["cpu"], ["rms_norm"], ["tiny", "glm5"])
    items = suite.plan(*choices)
    strip = lambda rs: [dict(r.to_dict(), duration_ms=None) for r in rs]
    assert strip(runner.run_all(items, workers=2, choices=choices)) == strip(runner.run_all(items))


# -- the entry points, in fresh processes -------------------------------------------------------
@pytest.fixture
def wrong_site(tmp_path):
    return write_dist(tmp_path / "site", "wrong-vendor", "wrong_vendor", WRONG_VENDOR,
                      {"wrongvendor": "wrong_vendor"})


def expected_counts(hal_state) -> dict[str, int]:
    hal_state(wrong_vendor_plugin(), "wrongvendor")
    records = runner.run_all(suite.plan(["wrongvendor", "offvendor"], ["rms_norm"], ["tiny"]))
    return dict(report.totals(records))


def conformance_cli(*args, path=()):
    return run_python(f"import sys, glm5_hal.cli as c; sys.exit(c.main({list(args)!r}))", path=path)


@pytest.mark.slow
def test_cli_exit_codes_and_reports(tmp_path, wrong_site, hal_state):
    want = expected_counts(hal_state)
    assert want == {"pass": 14 + 9, "fail": 10, "error": 12, "fallback": 3, "skip": 1}   # 9 expected errors
    out = tmp_path / "reports"
    proc = conformance_cli("conformance", "--backend", "wrongvendor", "--backend", "offvendor",
                           "--backend", "cpu", "--op", "rms_norm", "--preset", "tiny", "--json", str(out / "c.json"),
                           "--junit", str(out / "c.xml"), "--markdown", str(out / "c.md"), path=[wrong_site])
    assert proc.returncode == 1, proc.stderr
    data = json.loads((out / "c.json").read_text())
    by_backend = {b: dict(report.totals([Record.from_dict(r) for r in data["records"] if r["backend"] == b]))
                  for b in ("wrongvendor", "offvendor", "cpu")}
    assert {k: v for k, v in want.items() if k != "skip"} == by_backend["wrongvendor"]
    assert by_backend["offvendor"] == {"skip": 1} and by_backend["cpu"] == {"pass": 48}
    assert re.search(r"rms_norm\s+23 pass, 10 fail, 12 error, 3 fallback\s+1 skip\s+48 pass", proc.stdout), proc.stdout
    assert "ERROR    wrongvendor rms_norm/tiny/rows1_dim1/bfloat16: RuntimeError: kernel launch failed" in proc.stdout
    assert ET.parse(out / "c.xml").getroot().find("testsuite") is not None
    assert "`wrongvendor`" in (out / "c.md").read_text()
    assert "[97/97] cpu rms_norm: 48 pass" in proc.stderr   # progress: one line per (backend, op)


@pytest.mark.slow
def test_cli_passes_in_parallel_and_refuses_unknown_names(tmp_path):
    ok = conformance_cli("conformance", "--backend", "cpu", "--op", "rms_norm", "--preset", "tiny", "-n", "2")
    assert ok.returncode == 0, ok.stderr
    assert "total: 48 pass" in ok.stdout and not list(tmp_path.glob("*.json"))
    for bad in (["--backend", "nosuch"], ["--op", "nosuch"]):
        proc = conformance_cli("conformance", *bad)
        assert proc.returncode == 2 and "glm5-hal: error: conformance: unknown" in proc.stderr


def pytest_run(*args, path=(), cwd):
    env_path = ":".join(str(p) for p in path)
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLM5_HAL_", "PYTEST_"))}
    if env_path:
        env["PYTHONPATH"] = env_path + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.slow
def test_pytest_pyargs_entry_maps_statuses(tmp_path, wrong_site, hal_state):
    want = expected_counts(hal_state)
    proc = pytest_run("--pyargs", "glm5_hal.conformance", "--glm5-backend", "wrongvendor",
                      "--glm5-backend", "offvendor", "--glm5-op", "rms_norm", "--glm5-preset", "tiny", "-n", "2", "-rfs",
                      path=[wrong_site], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert f"{want['fail'] + want['error']} failed" in summary
    assert f"{want['pass']} passed" in summary
    assert f"{want['fallback'] + want['skip']} skipped" in summary
    assert "fallback: 2-d x only" in proc.stdout and "backend unavailable: no WrongChip device found" in proc.stdout
    assert "RuntimeError: kernel launch failed" in proc.stdout and "margin" in proc.stdout
    assert "suite.py::rms_norm/tiny/rows3_dim17/float16[wrongvendor]" in proc.stdout

    ok = pytest_run("--pyargs", "glm5_hal.conformance", "--glm5-backend", "cpu", "--glm5-op", "rms_norm",
                    "--glm5-preset", "glm5", "-n", "2", "-q", cwd=tmp_path)
    assert ok.returncode == 0 and "12 passed" in ok.stdout, ok.stdout[-3000:]


@pytest.mark.slow
def test_suite_is_collected_only_when_named(tmp_path):
    named = pytest_run("--collect-only", "-q", "core/glm5_hal/conformance", "--glm5-backend", "cpu",
                       "--glm5-op", "rms_norm", "--glm5-preset", "glm5", cwd=REPO)
    assert "12 tests collected" in named.stdout, named.stdout[-2000:]
    whole = pytest_run("--collect-only", "-q", "core", cwd=REPO)
    assert "suite.py" not in whole.stdout and whole.returncode == 5, whole.stdout[-2000:]
