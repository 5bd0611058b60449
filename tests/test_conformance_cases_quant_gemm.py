"""Conformance cases of the GEMMs on the checkpoint formats and int8_quant (docs/ops/quant.md): the
reference passes them, deliberately wrong backends fail the cases that expose their bug,
plausible correct variants pass, and the Int8Codes rule behaves as documented."""
from __future__ import annotations

import pytest
import torch

from glm5_hal import reference as ref
from glm5_hal.conformance import cases, runner, suite
from glm5_hal.conformance.cases.quant import Int8Codes
from glm5_hal.conformance.compare import exact

from test_conformance_cases_a import backend_with, failing, ids, result_cases, results_differ, run

OPS = ["fp8_block_gemm", "fp8_grouped_gemm", "int8_quant", "int8_gemm", "int8_grouped_gemm"]
FP8, I8 = torch.float8_e4m3fn, torch.int8


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_tiny_glm5_edge_and_error_cases(op):
    tiny, glm5 = cases.cases(op, "tiny"), cases.cases(op, "glm5")
    assert tiny and glm5
    names = {c.name for c in tiny}
    assert any("empty" in n for n in names), f"{op}: no empty-batch case"
    assert any(c.outcome == "error" for c in tiny) and any(c.outcome == "result_or_error" for c in tiny)
    if op != "int8_quant":   # every output dtype, decode and prefill row counts
        assert {"bf16out", "fp16out", "fp32out"} <= {c.name.rsplit("_", 1)[1] for c in tiny}


def test_the_reference_passes_every_tiny_case():
    records = runner.run_all(suite.plan(["reference"], OPS, ["tiny"]))
    bad = [(r.case, r.status, r.reason) for r in records if r.status != "pass"]
    assert not bad, bad[:5]


# -- the reference against an independent float64 formulation ------------------------------------
# The runner judges a backend against the reference, so "the reference passes its own cases" only
# compares the reference's float32 arithmetic with its own float64 one: a wrong formula (a scale
# applied to the wrong block) passes. Here the backend under test is an independent formulation
# in float64, written from docs/ops/quant.md without the reference's code (each element's scale found by
# index, not by repeating blocks; integer products summed exactly), so the reference, as judge,
# must agree with it on every case.
def _element_scales(scale: torch.Tensor, rows: int, cols: int, block_rows: int) -> torch.Tensor:
    """The scale of element (i, j): scale[i // block_rows, j // 128], in float64."""
    r = torch.arange(rows, device=scale.device) // block_rows
    c = torch.arange(cols, device=scale.device) // 128
    return scale.double()[r][:, c]


def float64_fp8_block_gemm(a, a_scale, w, w_scale, out_dtype=torch.bfloat16):
    (m, k), n = a.shape, w.shape[0]
    a64 = a.double().mul_(_element_scales(a_scale, m, k, 1))
    w64 = w.double().mul_(_element_scales(w_scale, n, k, 128))
    return (a64 @ w64.T).to(out_dtype)


def float64_int8_gemm(x, x_scale, w, w_scale, out_dtype=torch.bfloat16, bias=None):
    # every |sum of int8 products| <= K * 128^2 < 2^53: exact in float64
    out = (x.double() @ w.double().T).mul_(x_scale.double()[:, None] * w_scale.double()[None, :])
    return (out if bias is None else out + bias.double()).to(out_dtype)


def _per_expert(gemm, x, x_scale, w, w_scale, tokens_per_expert, out_dtype):
    out, start = torch.zeros(x.shape[0], w.shape[1], dtype=out_dtype), 0
    for e, rows in enumerate(tokens_per_expert.tolist()):
        if rows:
            out[start:start + rows] = gemm(x[start:start + rows], x_scale[start:start + rows], w[e], w_scale[e],
                                           out_dtype)
        start += rows
    return out


def float64_fp8_grouped_gemm(a, a_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16):
    return _per_expert(float64_fp8_block_gemm, a, a_scale, w, w_scale, tokens_per_expert, out_dtype)


def float64_int8_grouped_gemm(x, x_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16):
    return _per_expert(float64_int8_gemm, x, x_scale, w, w_scale, tokens_per_expert, out_dtype)


def float64_int8_quant(x):
    x64 = x.double()
    scale = (x64.abs().amax(dim=-1) / 127).float()          # the format's scales are float32
    q = torch.round(x64 / scale.double().unsqueeze(-1)).clamp_(-127, 127)
    return torch.where(scale.unsqueeze(-1) == 0, 0.0, q).to(I8), scale


def float64_backend():
    return backend_with("float64", fp8_block_gemm=float64_fp8_block_gemm, int8_gemm=float64_int8_gemm,
                        fp8_grouped_gemm=float64_fp8_grouped_gemm, int8_grouped_gemm=float64_int8_grouped_gemm,
                        int8_quant=float64_int8_quant)


@pytest.mark.parametrize("op", OPS)
def test_the_reference_agrees_with_an_independent_float64_formulation_on_every_tiny_case(hal_state, op):
    records = run(hal_state, float64_backend(), op)
    assert not failing(records), [(c, records[c].reason) for c in sorted(failing(records))][:3]


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_the_reference_agrees_with_an_independent_float64_formulation_on_every_glm5_case(hal_state, op):
    """GLM-5's shapes (K = 16384, M = 4096, 16 experts): what the tiny cases cannot reach."""
    records = run(hal_state, float64_backend(), op, presets=("glm5",))
    assert records and not failing(records), [(c, records[c].reason) for c in sorted(failing(records))][:3]


# -- deliberately wrong FP8 GEMMs ------------------------------------------------------------------
def scale_divides(a, a_scale, w, w_scale, out_dtype=torch.bfloat16):
    """Reads `weight_scale_inv` as an inverse (divides by it)."""
    return ref.fp8_block_gemm(a, a_scale, w, 1 / w_scale, out_dtype)


def first_block_row_only(a, a_scale, w, w_scale, out_dtype=torch.bfloat16):
    """Every weight row takes the scales of block row 0 (a partial last block goes wrong)."""
    return ref.fp8_block_gemm(a, a_scale, w, w_scale[:1].expand_as(w_scale).contiguous(), out_dtype)


def bf16_dequantized(a, a_scale, w, w_scale, out_dtype=torch.bfloat16):
    """Dequantizes both operands to bfloat16 (scale folded in, rounded) before the product."""
    ad = ref.quant._scaled_blocks(a.float(), a_scale.float()).bfloat16().float()
    wd = ref.quant.fp8_block_dequantize(w, w_scale.float()).bfloat16().float()
    return (ad @ wd.T).to(out_dtype)


def test_fp8_weight_scale_read_as_an_inverse_fails_every_nonzero_case(hal_state):
    records = run(hal_state, backend_with("inverse", fp8_block_gemm=scale_divides), "fp8_block_gemm")
    zero = ids("fp8_block_gemm", {f"{n}_{o}" for n in ("empty_m", "empty_n", "k0")
                                  for o in ("bf16out", "fp16out", "fp32out")}, dtypes=("float8_e4m3fn",))
    assert failing(records) == result_cases("fp8_block_gemm") - zero


def test_fp8_partial_weight_block_scales_are_checked(hal_state):
    records = run(hal_state, backend_with("row0", fp8_block_gemm=first_block_row_only), "fp8_block_gemm")
    assert {c.split("/")[2].rsplit("_", 1)[0] for c in failing(records)} == {
        "m17_n129_k256", "m33_n200_k384", "m64_n256_k256", "m300_n130_k640", "zero_scales", "noncontig_scales"}


def test_fp8_bf16_dequantization_fails_float32_outputs(hal_state):
    records = run(hal_state, backend_with("bf16deq", fp8_block_gemm=bf16_dequantized), "fp8_block_gemm")
    fp32 = {c for c in result_cases("fp8_block_gemm") if "fp32out" in c and not any(
        z in c for z in ("empty_m", "empty_n", "k0", "nan_codes"))}
    assert fp32 <= failing(records)


def wrong_expert_weights(a, a_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16):
    """Every expert's rows times expert 0's weight."""
    counts = tokens_per_expert.clone()
    counts.zero_()
    if counts.numel():
        counts[0] = a.shape[0]
    return ref.fp8_grouped_gemm(a, a_scale, w, w_scale, counts, out_dtype)


def test_fp8_grouped_with_one_expert_weight_fails(hal_state):
    records = run(hal_state, backend_with("e0", fp8_grouped_gemm=wrong_expert_weights), "fp8_grouped_gemm")
    same = {"e1_m1", "empty_batch", "no_experts"}
    assert {c.split("/")[2].split("_n")[0] for c in failing(records)} == {
        c.split("/")[2].split("_n")[0] for c in result_cases("fp8_grouped_gemm")} - same


# -- deliberately wrong INT8 ops --------------------------------------------------------------------
def float32_accumulation(x, x_scale, w, w_scale, out_dtype=torch.bfloat16, bias=None):
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):   # sequential float32 sum, as a float GEMM would round it
        acc += x[:, k:k + 1].float() * w[:, k].float()
    out = acc * x_scale.float()[:, None] * w_scale.float()[None, :]
    return (out if bias is None else out + bias.float()).to(out_dtype)


def test_int8_float32_accumulation_fails_the_exact_sum_cases(hal_state):
    # the O(K) Python loop: only the cases that need it
    only = {c for c in result_cases("int8_gemm") if "cancelling" in c}
    records = run(hal_state, backend_with("f32acc", int8_gemm=float32_accumulation), "int8_gemm")
    assert only <= failing(records)


def saturating_pairs(x, x_scale, w, w_scale, out_dtype=torch.bfloat16, bias=None):
    """vpmaddubsw-style: (x + 128) * w summed in saturating int16 pairs."""
    xu = x.long() + 128
    k = x.shape[1] - x.shape[1] % 2
    pairs = (xu[:, None, :k] * w.long()[None, :, :k]).reshape(x.shape[0], w.shape[0], k // 2, 2).sum(-1)
    acc = pairs.clamp(-32768, 32767).sum(-1) - 128 * w.long()[:, :k].sum(-1)
    if k < x.shape[1]:
        acc = acc + x.long()[:, -1:] * w.long()[:, -1]
    out = acc.double() * x_scale.double()[:, None] * w_scale.double()[None, :]
    return (out if bias is None else out + bias.double()).to(out_dtype)


def test_int8_saturating_pairs_fail_the_full_range_case(hal_state):
    records = run(hal_state, backend_with("sat", int8_gemm=saturating_pairs), "int8_gemm")
    assert ids("int8_gemm", {"full_range_bf16out", "full_range_fp16out", "full_range_fp32out"},
               dtypes=("int8",)) <= failing(records)


def truncating_int8_quant(x):
    xf = x.float()
    s = xf.abs().amax(-1) / 127
    q = torch.trunc(xf / torch.where(s == 0, 1.0, s).unsqueeze(-1)).clamp(-127, 127)
    return q.to(I8), s


def reciprocal_int8_quant(x):
    """x * (127 / amax): not the contract's division, but within its midpoint window."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    inv = torch.where(amax == 0, 0.0, 127 / amax)
    return torch.round(xf * inv.unsqueeze(-1)).clamp(-127, 127).to(I8), amax / 127


def test_int8_quant_truncation_is_caught(hal_state):
    records = run(hal_state, backend_with("trunc", int8_quant=truncating_int8_quant), "int8_quant")
    differ = results_differ("int8_quant", truncating_int8_quant)
    assert failing(records) == differ and len(differ) > 30
    assert all(records[c].reason.startswith("out[0]:") for c in failing(records))


def test_int8_quant_by_reciprocal_multiplication_passes_but_for_subnormal_maxima(hal_state):
    records = run(hal_state, backend_with("recip", int8_quant=reciprocal_int8_quant), "int8_quant")
    # 127 / amax overflows to inf when amax is a float32 subnormal: the underflow case catches it
    assert failing(records) == {"int8_quant/tiny/underflow/float32"}


def test_int8_codes_accept_either_neighbour_only_near_inexact_midpoints():
    codes = Int8Codes("out[1]", source="x")
    # scale 127 / 126.99 (not a power of two): 2.5 and -3.5 of the scale are midpoints only up
    # to float32 noise of the quotient, so either neighbour passes; 2.6 must give 3
    s = torch.tensor([127.0 / 126.99])
    x = torch.tensor([[126.99, 2.5, 2.6, -3.5]]) * s
    resolve = {"out[1]": s, "x": x}.__getitem__
    want = codes(torch.tensor([[127, 2, 3, -4]], dtype=I8), resolve)[0]
    assert exact(codes(torch.tensor([[127, 3, 3, -3]], dtype=I8), resolve)[0], want).ok
    assert not exact(codes(torch.tensor([[127, 2, 2, -4]], dtype=I8), resolve)[0], want).ok
    # a power-of-two scale makes every quotient exact: a midpoint must go to the even code
    resolve = {"out[1]": torch.tensor([1.0]), "x": torch.tensor([[127.0, 2.5, 2.6, -3.5]])}.__getitem__
    want = codes(torch.tensor([[127, 2, 3, -4]], dtype=I8), resolve)[0]
    assert not exact(codes(torch.tensor([[127, 3, 3, -4]], dtype=I8), resolve)[0], want).ok
