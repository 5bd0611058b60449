"""Conformance cases of the common (silu_and_mul, apply_rope, hadamard_transform), quant and
kv families: the reference passes them, deliberately wrong backends fail exactly the cases
that expose their bug, plausible correct variants pass, and the rules these cases rely on
(Close's per-element slack, Fp8Codes) behave as documented."""
from __future__ import annotations

import functools
import math

import pytest
import torch

import glm5_hal as hal
from glm5_hal import reference as ref
from glm5_hal.conformance import cases, runner, suite
from glm5_hal.conformance.case import ERROR
from glm5_hal.conformance.cases.common import rope_slack
from glm5_hal.conformance.cases.quant import pack_nibbles
from glm5_hal.conformance.compare import Close, close, exact
from glm5_hal.conformance.record import Record
from glm5_hal.conformance.tolerance import tolerance
from glm5_hal.conformance.transforms import Fp8Codes, Fp8Dequant

FP8 = torch.float8_e4m3fn
DTYPES = ("float32", "float16", "bfloat16")
FAMILIES = {
    "common": ["silu_and_mul", "apply_rope", "hadamard_transform"],
    "quant": ["fp8_block_quant", "int4_fake_quant", "int4_pack", "int4_unpack", "w4a16_gemm"],
    "kv": ["kv_cache_write", "indexer_k_cache_write", "kv_cache_gather"],
}


def backend_with(name: str, **impls) -> hal.Backend:
    class _B(hal.Backend):
        device_type, priority = "cpu", -1

        def probe(self):
            return hal.Availability(True, "test backend")

        def capabilities(self):
            return hal.Capabilities(dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, FP8}))

    _B.name = name
    backend = _B()
    for op, fn in impls.items():
        backend.impl(op)(fn)
    return backend


def run(hal_state, backend: hal.Backend, op: str, presets=("tiny",)) -> dict[str, Record]:
    import types
    module = types.ModuleType(f"plugin_{backend.name}")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(module, backend.name)
    records = runner.run_all(suite.plan([backend.name], [op], list(presets)))
    assert {r.status for r in records} <= {"pass", "fail"}, [(r.case, r.reason) for r in records
                                                             if r.status not in ("pass", "fail")]
    return {r.case: r for r in records}


def failing(records: dict[str, Record]) -> set[str]:
    return {c for c, r in records.items() if r.status == "fail"}


def case_names(records: dict[str, Record]) -> set[str]:
    return {c.split("/")[2] for c in records}


def ids(op: str, names, presets=("tiny",), dtypes=DTYPES) -> set[str]:
    """Case ids of `op` whose name is in `names` (any preset in `presets`) and dtype in `dtypes`."""
    return {c.id for p in presets for c in cases.cases(op, p)
            if c.name in names and c.id.rsplit("/", 1)[1] in dtypes}


def error_names(op: str) -> set[str]:
    """Names of the op's expected-error cases: rejected by the op's checks before any backend runs."""
    return {c.name for c in cases.cases(op, "tiny") if c.outcome == ERROR}


def result_cases(op: str, presets=("tiny",)) -> set[str]:
    return {c.id for p in presets for c in cases.cases(op, p) if c.outcome != ERROR}


def cpu_args(case) -> tuple:
    """The case's inputs as the op sees them (views taken)."""
    return tuple(a.on(a.base.clone()) if hasattr(a, "on") else
                 a.clone() if isinstance(a, torch.Tensor) else a for a in case.make_inputs())


def results_differ(op: str, wrong, presets=("tiny",)) -> set[str]:
    """Ids of the result cases where `wrong` computes other bits than the reference, run on
    the same inputs in the dtype under test (outputs and in-place destinations)."""
    differ = set()
    for p in presets:
        for case in cases.cases(op, p):
            if case.outcome == ERROR:
                continue
            want_args, got_args = cpu_args(case), cpu_args(case)
            want, got = getattr(ref, op)(*want_args), wrong(*got_args)
            pairs = list(zip(want, got)) if isinstance(want, tuple) else [(want, got)]
            pairs += [(w, g) for w, g in zip(want_args, got_args) if isinstance(w, torch.Tensor)]
            if any(w is not None and not torch.equal(_bits(w), _bits(g)) for w, g in pairs):
                differ.add(case.id)
    return differ


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


# -- the reference passes every case -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_reference_passes_every_case(family):
    ops = FAMILIES[family]
    records = runner.run_all(suite.plan(["reference"], ops, ["tiny", "glm5"]))
    assert {r.op for r in records} == set(ops)
    bad = [(r.case, r.status, r.reason) for r in records if r.status != "pass"]
    assert not bad, bad[:5]
    assert all(r.margin is None or r.margin <= 1 for r in records)


@pytest.mark.parametrize("op", [op for ops in FAMILIES.values() for op in ops])
def test_every_op_has_tiny_glm5_and_edge_cases(op):
    tiny, glm5 = cases.cases(op, "tiny"), cases.cases(op, "glm5")
    assert tiny and glm5
    names = {c.name for c in tiny}
    assert any("empty" in n for n in names), f"{op}: no empty-batch case"
    assert any(c.outcome != "result" for c in tiny), f"{op}: no non-contiguous or error case"
    dtypes = {c.dtype for c in tiny + glm5}
    if op == "int4_unpack":
        assert dtypes == {torch.int32}
    else:
        assert {torch.float32, torch.float16, torch.bfloat16} <= dtypes


# -- deliberately wrong backends ------------------------------------------------------------
# Each runs on the tiny preset (fast) and on glm5 (slow: real widths) and must fail exactly the
# cases that expose its bug: names of cases it cannot be told apart on are listed with the
# reason, and where that depends on the drawn data, `results_differ` says which cases differ.
PRESETS = [pytest.param(("tiny",), id="tiny"), pytest.param(("glm5",), id="glm5", marks=pytest.mark.slow)]
EVERY_CACHE_DTYPE = (*DTYPES, "float8_e4m3fn")


def at_slots(cache, slots):
    """(blocks, offsets) of flat slots in a paged cache, contiguous or a block-strided view."""
    return slots // cache.shape[1], slots % cache.shape[1]


def next_slot_too(cache, values, slot_mapping):
    ref.kv_cache_write(cache, values, slot_mapping)
    for t, s in enumerate(slot_mapping.tolist()):
        if 0 <= s < cache.shape[0] * cache.shape[1] - 1:
            cache[(s + 1) // cache.shape[1], (s + 1) % cache.shape[1]] = values[t]


@pytest.mark.parametrize("presets", PRESETS)
def test_a_cache_write_touching_the_next_slot_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("spill", kv_cache_write=next_slot_too), "kv_cache_write", presets)
    nothing_written = ids("kv_cache_write", {"empty_batch", "all_padding"}, presets, EVERY_CACHE_DTYPE)
    assert failing(records) == result_cases("kv_cache_write", presets) - nothing_written
    assert all("cache: " in records[c].reason and "differ (bit-exact rule)" in records[c].reason
               for c in failing(records))


def padding_to_slot_zero(cache, values, slot_mapping):
    ref.kv_cache_write(cache, values, slot_mapping)
    padded = (slot_mapping == -1).nonzero().flatten()
    if padded.numel():
        cache[0, 0] = values[padded[-1]]


@pytest.mark.parametrize("presets", PRESETS)
def test_a_cache_write_sending_padding_to_slot_zero_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("pad0", kv_cache_write=padding_to_slot_zero), "kv_cache_write",
                  presets)
    padded = {"padding_slots", "all_padding", "mla_decode_padded"}
    assert failing(records) == ids("kv_cache_write", padded, presets, EVERY_CACHE_DTYPE)


def test_invalid_slot_mappings_are_rejected_before_any_backend_writes():
    """The error cases are decided before a backend runs: the op validates the whole slot
    mapping first, so no backend can leave a partial write behind."""
    [case] = [c for c in cases.cases("kv_cache_write", "tiny")
              if c.name == "duplicate_slots" and c.dtype == torch.float32]
    cache, values, slots = case.make_inputs()
    before = cache.clone()
    with pytest.raises(hal.InvalidInputError, match="slot 3 more than once"):
        hal.ops.kv_cache_write(cache, values, slots)
    assert torch.equal(cache, before)


def next_block(cache, block_table, context_lens):
    return ref.kv_cache_gather(cache, (block_table + 1) % cache.shape[0], context_lens)


@pytest.mark.parametrize("presets", PRESETS)
def test_a_gather_off_by_one_block_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("offbyone", kv_cache_gather=next_block), "kv_cache_gather", presets)
    empty = ids("kv_cache_gather", {"empty_batch"}, presets, EVERY_CACHE_DTYPE)
    assert failing(records) == result_cases("kv_cache_gather", presets) - empty


def truncate_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 |v| <= 448 to float8_e4m3fn, rounding toward zero."""
    nearest = v.to(FP8)
    bits = nearest.view(torch.uint8)
    rounded_up = nearest.float().abs() > v.abs()
    return torch.where(rounded_up, bits - 1, bits).view(FP8)


def truncating_fp8_block_quant(x, block, scale_fmt):
    q, scale = ref.fp8_block_quant(x, block, scale_fmt)
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    v = (blocks / scale.unsqueeze(-1)).clamp(-448, 448)
    return truncate_to_e4m3(v).reshape(x.shape), scale


def truncating_indexer_k_cache_write(k, k_cache, k_scale, slot_mapping, scale_fmt):
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    q, scale = truncating_fp8_block_quant(k[written], k.shape[-1], scale_fmt)
    k_cache.index_put_(at_slots(k_cache, slots), q)
    k_scale.index_put_(at_slots(k_scale, slots), scale.squeeze(-1).to(k_scale.dtype))


@pytest.mark.parametrize("presets", PRESETS)
def test_an_indexer_cache_write_that_truncates_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("trunc_k", indexer_k_cache_write=truncating_indexer_k_cache_write),
                  "indexer_k_cache_write", presets)
    differ = results_differ("indexer_k_cache_write", truncating_indexer_k_cache_write, presets)
    assert failing(records) == differ
    # a row of one element with a plain scale is +-448 (nothing to round); with ue8m0 it may
    # or may not need rounding; an empty batch writes nothing
    same = {c.split("/")[2] for c in result_cases("indexer_k_cache_write", presets) - differ}
    assert same <= {"nb3_bs1_d1_fp32scale", "nb3_bs1_d1_ue8m0", "empty_batch_fp32scale", "empty_batch_ue8m0"}
    assert all(records[c].reason.startswith("k_cache:") for c in failing(records))


def scale_also_in_next_slot(k, k_cache, k_scale, slot_mapping, scale_fmt):
    ref.indexer_k_cache_write(k, k_cache, k_scale, slot_mapping, scale_fmt)
    written = slot_mapping[slot_mapping >= 0].long()
    k_scale[at_slots(k_scale, (written + 1) % k_scale.numel())] = k_scale[at_slots(k_scale, written)].clone()


@pytest.mark.parametrize("presets", PRESETS)
def test_an_indexer_cache_write_putting_a_scale_in_the_next_slot_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("scale_slot", indexer_k_cache_write=scale_also_in_next_slot),
                  "indexer_k_cache_write", presets)
    empty = ids("indexer_k_cache_write", {"empty_batch_fp32scale", "empty_batch_ue8m0"}, presets)
    assert failing(records) == result_cases("indexer_k_cache_write", presets) - empty
    assert all("k_scale:" in records[c].reason for c in failing(records))


def always_half_split(x, positions, theta, interleaved):
    return ref.apply_rope(x, positions, theta, False)


@pytest.mark.parametrize("presets", PRESETS)
def test_rope_with_the_half_split_pairing_is_caught_on_interleaved_cases(hal_state, presets):
    records = run(hal_state, backend_with("neox", apply_rope=always_half_split), "apply_rope", presets)
    half_split = {n for n in case_names(records) if "half_split" in n}
    # angle 0, no tokens, or R = 2 (both pairings are (x0, x1)): nothing to tell apart
    same = {"position_zero", "empty_batch", "t1_h1_r2"}
    assert {c.split("/")[2] for c in failing(records)} == case_names(records) - half_split - same - error_names("apply_rope")
    assert all(records[c].margin > 10 for c in failing(records))


def hf_rope(x, positions, theta, interleaved):
    """inv_freq = 1 / theta^(arange(0, R, 2) / R), cos/sin of float32 angles: how model code
    builds its cos/sin cache, with other roundings than the reference's."""
    r = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    angle = (positions.float()[:, None] * inv_freq[None, :])[:, None, :]
    cos, sin = angle.cos(), angle.sin()
    xf = x.float()
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = torch.stack((ra, rb), -1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
    return out.to(x.dtype)


@pytest.mark.parametrize("presets", PRESETS)
def test_rope_in_float32_written_the_model_code_way_passes(hal_state, presets):
    records = run(hal_state, backend_with("hfrope", apply_rope=hf_rope), "apply_rope", presets)
    assert not failing(records)


def test_large_positions_need_the_rope_slack():
    [case] = [c for c in cases.cases("apply_rope", "tiny")
              if c.name == "max_positions" and c.dtype == torch.bfloat16]
    args = cpu_args(case)
    exact = ref.apply_rope(args[0].double(), *args[1:])
    got = hf_rope(*args).double()
    assert not close(got, exact, tolerance(torch.bfloat16)).ok
    assert close(got, exact, tolerance(torch.bfloat16), slack=rope_slack(args[0].double(), *args[1:]),
                 slack_why="rope").ok


def test_the_rope_slack_grows_with_the_angle_and_stays_small():
    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = torch.tensor([0, 1, 4096, 202751])
    slack = rope_slack(x, positions, 1e6, True)
    pair = x[..., 0::2].hypot(x[..., 1::2]).repeat_interleave(2, dim=-1)
    assert torch.allclose(slack[0], pair[0] * 4 * 2.0 ** -24, rtol=1e-12, atol=0)   # angle 0
    fastest = slack[3, :, :2] / pair[3, :, :2]                                        # angle = position
    assert torch.allclose(fastest, torch.full_like(fastest, (4 + 4 * 202751) * 2.0 ** -24))
    assert fastest.max() < 0.05                                                        # ~5% of |pair|
    assert (slack[3, :, -2:] / pair[3, :, -2:]).max() < 1e-6                           # slow pairs: tight


def unscaled_hadamard(x, scale):
    return ref.hadamard_transform(x, 1.0)


@pytest.mark.parametrize("presets", PRESETS)
def test_hadamard_without_the_scale_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("noscale", hadamard_transform=unscaled_hadamard),
                  "hadamard_transform", presets)
    # scale 1 (explicitly, or 1^-0.5 for D = 1) and no rows: nothing to tell apart
    assert {c.split("/")[2] for c in failing(records)} == case_names(records) - {
        "scale_one", "rows1_dim1", "empty_batch"} - error_names("hadamard_transform")


@functools.lru_cache(maxsize=None)
def sequency_order(d: int) -> torch.Tensor:
    """Sylvester row indices sorted by their number of sign changes (Walsh order)."""
    h = ref.hadamard_transform(torch.eye(d), 1.0)
    return (h[:, 1:] != h[:, :-1]).sum(1).argsort()


def hadamard_in_sequency_order(x, scale):
    return ref.hadamard_transform(x, scale)[..., sequency_order(x.shape[-1])]


def test_hadamard_in_sequency_order_is_caught(hal_state):
    records = run(hal_state, backend_with("walsh", hadamard_transform=hadamard_in_sequency_order),
                  "hadamard_transform")
    # D <= 2 has one order only; constant rows transform to (c * sqrt(D), 0, ..., 0), and row 0
    # (all ones) comes first in both orders
    same = {"rows1_dim1", "rows3_dim2", "empty_batch", "constant_rows_dim512"}
    assert {c.split("/")[2] for c in failing(records)} == case_names(records) - same - error_names("hadamard_transform")


def swapped_halves(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(up) * gate).to(x.dtype)


@pytest.mark.parametrize("presets", PRESETS)
def test_silu_and_mul_with_swapped_halves_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("swapped", silu_and_mul=swapped_halves), "silu_and_mul", presets)
    assert failing(records) == result_cases("silu_and_mul", presets) - ids("silu_and_mul", {"empty_batch"})


@pytest.mark.parametrize("presets", PRESETS)
def test_fp8_quant_rounding_toward_zero_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("rtz", fp8_block_quant=truncating_fp8_block_quant),
                  "fp8_block_quant", presets)
    differ = results_differ("fp8_block_quant", truncating_fp8_block_quant, presets)
    assert failing(records) == differ
    same = {c.split("/")[2] for c in result_cases("fp8_block_quant", presets) - differ}
    assert same <= {"rows1_k1_block1_fp32scale", "rows1_k1_block1_ue8m0", "empty_batch_fp32scale",
                    "empty_batch_ue8m0"}
    assert all(records[c].reason.startswith("out[0]:") for c in failing(records))


def test_fp8_rounding_toward_zero_passes_a_dequantized_comparison():
    """Why FP8 outputs are judged as codes: one e4m3 ulp is within the dequantized rule."""
    [case] = [c for c in cases.cases("fp8_block_quant", "glm5")
              if c.name == "hidden6144_fp32scale" and c.dtype == torch.bfloat16]
    x, block, fmt = case.make_inputs()
    q_ref, scale = ref.fp8_block_quant(x, block, fmt)
    q_rtz, _ = truncating_fp8_block_quant(x, block, fmt)
    unit = scale.double().repeat_interleave(block, -1)
    assert close(q_rtz.double() * unit, q_ref.double() * unit, tolerance(FP8), unit).ok
    resolve = {"out[1]": scale, "x": x}.__getitem__
    codes = Fp8Codes("out[1]", source="x")
    assert not exact(codes(q_rtz, resolve)[0], codes(q_ref, resolve)[0]).ok


def reciprocal_fp8_block_quant(x, block, scale_fmt):
    """x * (1 / s) instead of x / s (DeepGEMM multiplies by 448 / amax)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    scale = blocks.abs().amax(-1).clamp_min(1e-4) / 448
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks * (1.0 / scale).unsqueeze(-1)).clamp(-448, 448).to(FP8)
    return q.reshape(x.shape), scale


@pytest.mark.parametrize("presets", PRESETS)
def test_fp8_quant_by_reciprocal_multiplication_passes(hal_state, presets):
    records = run(hal_state, backend_with("recip", fp8_block_quant=reciprocal_fp8_block_quant),
                  "fp8_block_quant", presets)
    assert not failing(records)
    # it does differ from x / s: on midpoints hit exactly (bf16 inputs, scales like 7 * 2^-10)
    if presets == ("tiny",):
        assert results_differ("fp8_block_quant", reciprocal_fp8_block_quant, presets)


def ue8m0_rounded_down(x, block, scale_fmt):
    if scale_fmt != "ue8m0":
        return ref.fp8_block_quant(x, block, scale_fmt)
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(-1).clamp_min(1e-4) / 448)))
    q = (blocks / scale.unsqueeze(-1)).clamp(-448, 448).to(FP8)
    return q.reshape(x.shape), scale


@pytest.mark.parametrize("presets", PRESETS)
def test_ue8m0_scales_rounded_down_are_caught(hal_state, presets):
    records = run(hal_state, backend_with("floor8", fp8_block_quant=ue8m0_rounded_down), "fp8_block_quant",
                  presets)
    ue8m0 = {c for c in result_cases("fp8_block_quant", presets) if "_ue8m0/" in c}
    # amax = 448 * 2^k gives a power-of-two scale either way
    same = ids("fp8_block_quant", {"rounding_ties_ue8m0", "empty_batch_ue8m0"}, presets)
    assert failing(records) == ue8m0 - same
    assert all("out[1]: " in records[c].reason for c in failing(records))


_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def reversed_nibble_order(w, group_size):
    packed, scale = ref.int4_pack(w, group_size)
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS) & 0xF
    return pack_nibbles(nibbles.flip(-1).reshape(w.shape)), scale


@pytest.mark.parametrize("presets", PRESETS)
def test_int4_pack_with_reversed_nibble_order_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("msbfirst", int4_pack=reversed_nibble_order), "int4_pack", presets)
    assert failing(records) == results_differ("int4_pack", reversed_nibble_order, presets)
    # groups of one are all +-7 (nibbles 15 and 1): a word may read the same both ways
    same = {c.split("/")[2] for c in result_cases("int4_pack", presets) - failing(records)}
    assert same <= {"n1_k8_g1", "empty_rows"}
    assert all(records[c].reason.startswith("out[0]:") for c in failing(records))


def half_away_int4_fake_quant(w, group_size):
    n, k = w.shape
    wf = w.float().reshape(n, k // group_size, group_size)
    s = (wf.abs().amax(-1) / 7).clamp_min(1e-5).unsqueeze(-1)
    v = wf / s
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-7, 7) + 0.0
    return (q * s).reshape(n, k).to(w.dtype)


def test_int4_rounding_half_away_from_zero_fails_exactly_the_cases_with_ties(hal_state):
    records = run(hal_state, backend_with("halfaway", int4_fake_quant=half_away_int4_fake_quant),
                  "int4_fake_quant")
    # besides the built ties, half-precision weights often give w / s == k + 0.5 in float32
    assert failing(records) == results_differ("int4_fake_quant", half_away_int4_fake_quant)
    assert ids("int4_fake_quant", {"rounding_ties"}) <= failing(records)
    assert not ids("int4_fake_quant", {"n1_k8_g1", "zero_groups", "empty_rows"}) & failing(records)


def unpack_offset_seven(packed, scale, group_size):
    return ref.int4_unpack(packed, scale, group_size) + scale.repeat_interleave(group_size, dim=1)


@pytest.mark.parametrize("presets", PRESETS)
def test_int4_unpack_with_the_wrong_offset_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("off7", int4_unpack=unpack_offset_seven), "int4_unpack", presets)
    empty = ids("int4_unpack", {"empty_rows"}, presets, ("int32",))
    assert failing(records) == result_cases("int4_unpack", presets) - empty


def first_group_scale_only(x, packed, scale, group_size):
    return ref.w4a16_gemm(x, packed, scale[:, :1].expand_as(scale).contiguous(), group_size)


@pytest.mark.parametrize("presets", PRESETS)
def test_w4a16_gemm_ignoring_the_group_scales_is_caught(hal_state, presets):
    records = run(hal_state, backend_with("rowscale", w4a16_gemm=first_group_scale_only), "w4a16_gemm",
                  presets)
    # one group per row (K = group) or nothing to multiply: the same result
    same = ids("w4a16_gemm", {"m1_n1_k8_g8", "empty_m", "empty_n"}, presets)
    assert failing(records) == result_cases("w4a16_gemm", presets) - same


# -- the rules these cases rely on ---------------------------------------------------------------
def test_close_slack_adds_to_each_bound_and_needs_a_reason():
    want = torch.tensor([1.0, 1.0], dtype=torch.float64)
    got = torch.tensor([1.001, 1.001], dtype=torch.float64)
    tol = tolerance(torch.float32)
    assert not close(got, want, tol).ok
    verdict = close(got, want, tol, slack=torch.tensor([2e-3, 0.0], dtype=torch.float64), slack_why="w")
    assert not verdict.ok and verdict.worst["index"] == [1] and "per-element slack (w)" in verdict.message
    assert close(got, want, tol, slack=torch.tensor([2e-3, 2e-3], dtype=torch.float64), slack_why="w").ok
    with pytest.raises(ValueError, match="justification"):
        Close(slack=lambda *a: torch.zeros(()))


def fp8_codes(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(FP8)


def test_fp8_codes_demand_round_to_even_on_exact_midpoints():
    x = torch.tensor([[448.0, 1.0625, 1.1875, 3 * 2 ** -10]])
    scale = torch.ones(1, 1)
    resolve = {"s": scale, "x": x}.__getitem__
    codes = Fp8Codes("s", "x")
    want, unit = codes(fp8_codes([[448, 1.0, 1.25, 2 ** -8]]), resolve)
    assert unit.tolist() == [[1.0] * 4]
    for wrong in ([448, 1.125, 1.25, 2 ** -8], [448, 1.0, 1.125, 2 ** -8], [448, 1.0, 1.25, 2 ** -9]):
        got, _ = codes(fp8_codes([wrong]), resolve)
        assert int((got != want).sum()) == 1


def test_fp8_codes_accept_either_neighbour_only_near_a_midpoint():
    mid = 1.0625
    x = torch.tensor([[448.0, mid * (1 + 2 ** -22), mid * (1 - 2 ** -22), mid * (1 + 2 ** -17)]])
    resolve = {"s": torch.ones(1, 1), "x": x}.__getitem__
    codes = Fp8Codes("s", "x")
    want, _ = codes(fp8_codes([[448, 1.125, 1.0, 1.125]]), resolve)
    near_flips, _ = codes(fp8_codes([[448, 1.0, 1.125, 1.125]]), resolve)
    assert torch.equal(near_flips, want)
    far_flip, _ = codes(fp8_codes([[448, 1.125, 1.0, 1.0]]), resolve)
    assert (far_flip != want).tolist() == [[False, False, False, True]]
    two_off, _ = codes(fp8_codes([[448, 1.25, 1.0, 1.125]]), resolve)   # not a neighbour
    assert (two_off != want).tolist() == [[False, True, False, False]]


def test_fp8_codes_place_source_rows_by_slot_and_compare_other_rows_as_they_are():
    cache = fp8_codes([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    k = torch.tensor([[448.0, 1.0625 * (1 + 2 ** -22)]])
    resolve = {"k_scale": torch.ones(2, 2), "k": k, "slots": torch.tensor([2])}.__getitem__
    codes = Fp8Codes("k_scale", "k", slots="slots")
    cache[1, 0] = fp8_codes([448.0, 1.0])                               # the near flip
    got, _ = codes(cache, resolve)
    assert got[1, 0].tolist() == [448.0, 1.0]          # either neighbour -> the even one
    assert got[0].tolist() == [[1.0, 2.0], [3.0, 4.0]] and got[1, 1].tolist() == [7.0, 8.0]
    with pytest.raises(ValueError, match="do not fit"):
        Fp8Codes("k_scale", "k", slots="bad")(cache, {**{"k_scale": torch.ones(2, 2), "k": k},
                                                      "bad": torch.tensor([0, 1])}.__getitem__)


def test_fp8_codes_and_dequant_agree_on_the_blocking_of_scales():
    q = fp8_codes([[1.0, 2.0, 4.0, 8.0]])
    resolve = {"s": torch.tensor([[0.5, 2.0]]), "x": torch.tensor([[0.5, 1.0, 8.0, 16.0]])}.__getitem__
    codes, unit = Fp8Codes("s", "x")(q, resolve)
    deq, unit2 = Fp8Dequant("s")(q, resolve)
    assert torch.equal(unit, unit2) and torch.equal(codes * unit, deq)
    assert math.isclose(float(deq[0, 3]), 16.0)
