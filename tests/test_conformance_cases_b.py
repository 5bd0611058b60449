"""The DSA and MoE conformance cases (conformance/cases/dsa.py, moe.py): the reference passes
them all, and each deliberately wrong backend fails exactly the cases that expose its bug.

A wrong backend here is the reference with one bug added, registered at run time; the
cases it must fail are named, or derived from the case inputs by a predicate that states
the bug's reach (e.g. "some expert has two rows")."""
from __future__ import annotations

import math
import types

import pytest
import torch

import glm5_hal as hal
from glm5_hal import reference as ref
from glm5_hal.conformance import runner, suite
from glm5_hal.conformance.case import RESULT, Case, View
from glm5_hal.conformance.cases import cases
from glm5_hal.conformance.cases.moe import ROUTE_CHECKS, ROUTE_IDS
from glm5_hal.conformance.compare import Close, Context, exact, topk_set
from glm5_hal.conformance.tolerance import tolerance

DSA_OPS = ["indexer_logits", "indexer_topk", "indexer_topk_paged", "sparse_mla_attention",
           "sparse_mla_decode_paged", "dense_mla_decode_paged"]
MOE_OPS = ["moe_route", "moe_permute", "moe_unpermute", "grouped_gemm"]
DTYPES = ("float32", "float16", "bfloat16")
NEG_INF = float("-inf")


def wrong_backend(hal_state, name: str, **impls):
    """Registers a cpu backend `name` implementing `op=fn` for each keyword."""
    class _Wrong(hal.Backend):
        device_type, priority = "cpu", -1

    _Wrong.name = name
    backend = _Wrong()
    for op, fn in impls.items():
        backend.impl(op)(fn)
    module = types.ModuleType(f"plugin_{name}")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(module, name)
    return name


def run(backend: str, op: str, presets=("tiny",)) -> dict:
    return {r.case: r for r in runner.run_all(suite.plan([backend], [op], list(presets)))}


def failing(records: dict) -> set[str]:
    return {c for c, r in records.items() if r.status == "fail"}


def every_dtype(*names: str, preset: str = "tiny", op: str) -> set[str]:
    return {f"{op}/{preset}/{n}/{d}" for n in names for d in DTYPES}


def assert_only(records: dict, expected: set[str]) -> None:
    """Exactly `expected` fail; everything else passes (nothing errors or falls back)."""
    bad = {c: (r.status, r.reason[:200]) for c, r in records.items() if r.status not in ("pass", "fail")}
    assert not bad, bad
    got = failing(records)
    assert got == expected, {"missed": sorted(expected - got), "unexpected": sorted(got - expected)}


def materialised(case: Case) -> tuple:
    """The case's inputs as the op sees them (views taken)."""
    def one(a):
        if isinstance(a, View):
            return a.on(a.base)
        if isinstance(a, tuple):
            return tuple(one(x) for x in a)
        return a
    return tuple(one(a) for a in case.make_inputs())


def result_cases(op: str, preset: str = "tiny") -> list[Case]:
    return [c for c in cases(op, preset) if c.outcome != "error"]


# -- the framework pieces these cases rely on --------------------------------------------------
def test_close_expect_compares_against_a_value_recomputed_from_the_backend_outputs():
    got = {"out[0]": torch.tensor([[0.75, 0.25]]), "out[1]": torch.tensor([[1, 0]], dtype=torch.int32)}
    ctx = Context(got.__getitem__, {}.__getitem__, (torch.tensor([[1.0, 3.0]], dtype=torch.float64),))
    by_ids = lambda c: c.reference_args[0].gather(1, c.got("out[1]").long()) / 4
    want = torch.tensor([[0.25, 0.75]], dtype=torch.float64)   # the reference chose ids [0, 1]
    rule = Close(dtype=torch.float32, expect=by_ids)
    assert rule.judge(got["out[0]"], want, torch.float32, ctx).ok
    assert not Close(dtype=torch.float32).judge(got["out[0]"], want, torch.float32, ctx).ok
    broken = Close(expect=lambda c: c.reference_args[0].gather(1, torch.tensor([[5, 0]])))
    v = broken.judge(got["out[0]"], want, torch.float32, ctx)
    assert not v.ok and "cannot compute the expected value" in v.message


def test_topk_set_rule_over_zero_keys():
    assert topk_set(torch.full((2, 3), -1, dtype=torch.int32), torch.zeros(2, 0, dtype=torch.float64),
                    tolerance(torch.float32)).ok
    v = topk_set(torch.tensor([[0, -1, -1]], dtype=torch.int32), torch.zeros(1, 0, dtype=torch.float64),
                 tolerance(torch.float32))
    assert not v.ok and "an index >= 0 keys" in v.message


def test_exact_shortcut_keeps_value_semantics():
    assert exact(torch.tensor([0.0, 1.5]), torch.tensor([-0.0, 1.5])).ok        # -0 == 0 by value
    nan = torch.tensor([float("nan"), 2.0], dtype=torch.bfloat16)
    v = exact(nan, nan.clone())
    assert v.ok and v.max_abs == 0.0
    assert not exact(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32)).ok


# -- the case definitions ------------------------------------------------------------------
def test_every_op_has_tiny_and_glm5_cases_in_every_dtype():
    for op in DSA_OPS + MOE_OPS:
        for preset in ("tiny", "glm5"):
            found = {c.id.rsplit("/", 1)[1] for c in cases(op, preset)}
            assert found == set(DTYPES), (op, preset, found)
        names = {c.name for c in cases(op, "tiny")}
        assert "empty_batch" in names and any(n.startswith("noncontig") for n in names), op


def test_glm5_cases_use_the_real_layer_shapes():
    def first(op, name):
        return materialised(next(c for c in cases(op, "glm5") if c.name == name))
    q, k, w, ks, ke, topk = first("indexer_topk", "prefill_tail_keys5001")
    assert q.shape[1:] == (32, 128) and k.shape == (5001, 128) and topk == 2048
    q, cache, w, table, lens, topk = first("indexer_topk_paged", "fp8_cache_mtp_n2")
    assert q.shape[:3] == (2, 2, 32) and cache[0].dtype == torch.float8_e4m3fn and cache[0].shape[1] == 64
    q, kv, idx, scale, d_v = first("sparse_mla_attention", "prefill_keys4096")
    assert q.shape[1:] == (64, 576) and d_v == 512 and idx.shape[1] == 2048 and scale == 256 ** -0.5
    logits, bias, top_k, n_group, topk_group, factor, norm, func = first("moe_route", "dsv32_t5_e256_g8_tg4_top8")
    assert logits.shape[1] == 256 and (top_k, n_group, topk_group, factor) == (8, 8, 4, 2.5)
    x, w13, counts = first("grouped_gemm", "w13_e2_n4096_k6144")
    assert w13.shape == (2, 4096, 6144)


def test_inputs_are_deterministic_and_differ_per_dtype():
    c16, c32 = (next(c for c in cases("sparse_mla_decode_paged", "tiny") if c.name == "mtp_n2_bs17"
                     and c.id.endswith(d)) for d in ("bfloat16", "float32"))
    a, b = c16.make_inputs(), c16.make_inputs()
    assert all(torch.equal(x, y) for x, y in zip(a[:5], b[:5]))
    assert not torch.equal(a[0].float(), c32.make_inputs()[0].float())


def test_paged_layouts_poison_every_slot_no_sequence_owns():
    from glm5_hal.conformance.cases.dsa import Paging
    p = Paging((20, 4, 35), 17, extra_blocks=2, padding="garbage")
    num_blocks, table, lens, owned = p.layout(torch.Generator().manual_seed(0))
    assert table.shape == (3, 5) and lens.tolist() == [20, 4, 35]
    assert int(owned.sum()) == 59 and num_blocks == 2 + 1 + 3 + 2
    used = table[:, :3][torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)]
    assert sorted(used.tolist()) == sorted(set(used.tolist())) and used.max() < num_blocks
    assert ((table[0, 2:] < 0) | (table[0, 2:] >= num_blocks)).all()


# -- the reference passes (the cpu backend: tests/test_cpu_coverage.py) -----------------------
@pytest.mark.slow
@pytest.mark.parametrize("op", DSA_OPS + MOE_OPS)
def test_reference_passes_every_case(op):
    records = run("reference", op, ("tiny", "glm5"))
    assert {r.status for r in records.values()} == {"pass"}, [
        (c, r.reason) for c, r in records.items() if r.status != "pass"]


# -- correct implementations with other arithmetic pass --------------------------------------
def flash_sparse_attention(q, kv, indices, sm_scale, d_v, block=16, p_dtype=torch.float32):
    """Online softmax over blocks of the selected rows, exp2 with log2(e) folded into the
    scale (the usual kernel arithmetic), fp32 accumulation; the weights P rounded to `p_dtype`
    for the P @ V product (FlashMLA rounds them to the activation dtype)."""
    log2e = 1.4426950408889634
    valid = (indices >= 0) & (indices < kv.shape[0])
    rows = kv[torch.where(valid, indices, 0).long()].float()
    t, h = q.shape[0], q.shape[1]
    m = torch.full((t, h), NEG_INF)
    l, acc = torch.zeros(t, h), torch.zeros(t, h, d_v)
    for s in range(0, indices.shape[1], block):
        z = torch.einsum("thd,tkd->thk", q.float(), rows[:, s:s + block]) * (sm_scale * log2e)
        z = z.masked_fill(~valid[:, None, s:s + block], NEG_INF)
        m_new = torch.maximum(m, z.amax(-1))
        base = m_new.masked_fill(m_new == NEG_INF, 0.0)
        p, rescale = torch.exp2(z - base[..., None]), torch.exp2(m - base)
        l = l * rescale + p.sum(-1)
        p_v = p.to(p_dtype).float()
        acc = acc * rescale[..., None] + torch.einsum("thk,tkd->thd", p_v, rows[:, s:s + block, :d_v])
        m = m_new
    out = torch.where(l[..., None] > 0, acc / l.clamp(min=1e-30)[..., None], 0.0)
    lse = torch.where(l > 0, (base + torch.log2(l.clamp(min=1e-30))) / log2e, NEG_INF)
    return out.to(q.dtype), lse


@pytest.mark.slow
def test_an_online_softmax_kernel_passes_the_attention_cases(hal_state):
    records = run(wrong_backend(hal_state, "flash", sparse_mla_attention=flash_sparse_attention),
                  "sparse_mla_attention")
    assert_only(records, set())


@pytest.mark.slow
def test_p_rounded_to_the_activation_dtype_passes_and_coarser_p_is_caught(hal_state):
    """FlashMLA's arithmetic (P in the activation dtype for P @ V) is within the contract; P in
    a coarser format than the activations (e4m3) is not."""
    def p_like_q(q, kv, indices, sm_scale, d_v):
        return flash_sparse_attention(q, kv, indices, sm_scale, d_v, p_dtype=q.dtype)

    def p_in_fp8(q, kv, indices, sm_scale, d_v):
        return flash_sparse_attention(q, kv, indices, sm_scale, d_v, p_dtype=torch.float8_e4m3fn)
    assert_only(run(wrong_backend(hal_state, "flashp", sparse_mla_attention=p_like_q), "sparse_mla_attention"),
                set())
    records = run(wrong_backend(hal_state, "flashp8", sparse_mla_attention=p_in_fp8), "sparse_mla_attention")
    failed = {case for case, r in records.items() if r.status == "fail"}
    assert any("/bfloat16" in c for c in failed) and any("/float16" in c for c in failed), failed


def test_other_summation_orders_pass_the_reduction_cases(hal_state):
    def heads_reversed(q, k, weights, k_start, k_end):
        keys = (k[0].float() * k[1][:, None]) if isinstance(k, tuple) else k.float()
        logits = torch.zeros(q.shape[0], keys.shape[0])
        for h in reversed(range(q.shape[1])):
            logits += weights[:, h:h + 1] * (q[:, h].float() @ keys.T).relu()
        s = torch.arange(keys.shape[0])
        return logits.masked_fill((s < k_start[:, None]) | (s >= k_end[:, None]), NEG_INF)

    def split_k(x, w, tokens_per_expert):
        rows = x.float().split(tokens_per_expert.tolist())
        outs = [sum(r[:, i::3] @ w[e, :, i::3].float().T for i in range(3)) for e, r in enumerate(rows)]
        return (torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])).to(x.dtype)
    name = wrong_backend(hal_state, "reordered", indexer_logits=heads_reversed, grouped_gemm=split_k)
    assert_only(run(name, "indexer_logits"), set())
    assert_only(run(name, "grouped_gemm"), set())


# -- deliberately wrong backends: DSA --------------------------------------------------------
def test_indexer_dropping_the_last_in_range_key_is_caught(hal_state):
    def drops_last(q, k, weights, k_start, k_end):
        out = ref.indexer_logits(q, k, weights, k_start, k_end)
        rows = (k_end > k_start).nonzero().flatten()
        out[rows, k_end[rows].long() - 1] = NEG_INF
        return out
    records = run(wrong_backend(hal_state, "droplast", indexer_logits=drops_last), "indexer_logits")
    keyless = {"no_keys", "empty_batch"}
    expected = {c.id for c in result_cases("indexer_logits") if c.name not in keyless}
    assert_only(records, expected)
    r = records["indexer_logits/tiny/t1_h1_keys1/float32"]
    assert "non-finite values differ" in r.reason


def test_indexer_topk_with_duplicates_is_caught(hal_state):
    def duplicates(q, k, weights, k_start, k_end, topk):
        idx = ref.indexer_topk(q, k, weights, k_start, k_end, topk)
        count = (idx >= 0).sum(1)
        rows = (count >= 2).nonzero().flatten()
        idx[rows, count[rows] - 1] = idx[rows, 0]          # the last valid entry repeats the first
        return idx
    records = run(wrong_backend(hal_state, "dupes", indexer_topk=duplicates), "indexer_topk")
    def two_or_more(case):
        q, k, w, ks, ke, topk = materialised(case)
        return bool(((ke - ks).clamp(max=topk) >= 2).any())
    assert_only(records, {c.id for c in result_cases("indexer_topk") if two_or_more(c)})
    assert "duplicate indices" in records["indexer_topk/tiny/t3_h3_keys17/bfloat16"].reason


def test_indexer_topk_without_minus_one_padding_is_caught(hal_state):
    def unmasked(q, k, weights, k_start, k_end, topk):
        logits = ref.indexer_logits(q, k, weights, k_start, k_end)
        padded = torch.nn.functional.pad(logits, (0, max(0, topk - logits.shape[1])), value=NEG_INF)
        return torch.topk(padded, topk, dim=-1).indices.int()    # -inf keys fill short rows
    records = run(wrong_backend(hal_state, "nopad", indexer_topk=unmasked), "indexer_topk")
    def short_row(case):
        q, k, w, ks, ke, topk = materialised(case)
        return bool(((ke - ks) < topk).any())
    assert_only(records, {c.id for c in result_cases("indexer_topk") if short_row(c)})


def test_indexer_topk_with_a_clearly_worse_key_is_caught_but_ties_are_not(hal_state):
    def worse(q, k, weights, k_start, k_end, topk):
        logits = ref.indexer_logits(q, k, weights, k_start, k_end)
        idx = ref.indexer_topk(q, k, weights, k_start, k_end, topk)
        for t in range(idx.shape[0]):
            if int(k_end[t] - k_start[t]) > topk:         # swap the best key for the worst one left
                rest = logits[t].clone()
                rest[rest == NEG_INF] = float("inf")          # out of range: not a candidate
                rest[idx[t].long()] = float("inf")
                idx[t, 0] = int(rest.argmin())
        return idx
    records = run(wrong_backend(hal_state, "worse", indexer_topk=worse), "indexer_topk", ("tiny", "glm5"))
    def long_row(case):
        q, k, w, ks, ke, topk = materialised(case)
        return bool(((ke - ks) > topk).any())
    expected = {c.id for p in ("tiny", "glm5") for c in result_cases("indexer_topk", p)
                if long_row(c) and c.name != "tied_keys"}
    assert_only(records, expected)
    tied = records["indexer_topk/tiny/tied_keys/float32"]
    assert tied.status == "pass" and tied.margin < 1e-6    # equal scores: any key is as good
    assert "more than tau below" in records["indexer_topk/glm5/prefill_tail_keys5001/bfloat16"].reason


def test_paged_indexer_without_the_causal_limit_for_mtp_is_caught(hal_state):
    def sees_everything(q, k_cache, weights, block_table, context_lens, topk):
        out = [ref.indexer_topk_paged(q[:, i:i + 1], k_cache, weights[:, i:i + 1], block_table,
                                      context_lens, topk) for i in range(q.shape[1])]
        return torch.cat(out, dim=1) if out else ref.indexer_topk_paged(
            q, k_cache, weights, block_table, context_lens, topk)
    records = run(wrong_backend(hal_state, "acausal", indexer_topk_paged=sees_everything),
                  "indexer_topk_paged")
    def mtp_with_keys(case):
        q, lens = materialised(case)[0], materialised(case)[4]
        return q.shape[1] > 1 and bool((lens >= 1).any())
    assert_only(records, {c.id for c in result_cases("indexer_topk_paged") if mtp_with_keys(c)})


def test_sparse_attention_treating_minus_one_as_row_zero_is_caught(hal_state):
    def minus_one_is_zero(q, kv, indices, sm_scale, d_v):
        return ref.sparse_mla_attention(q, kv, torch.where(indices == -1, 0, indices), sm_scale, d_v)
    records = run(wrong_backend(hal_state, "minus1", sparse_mla_attention=minus_one_is_zero),
                  "sparse_mla_attention", ("tiny", "glm5"))
    expected = every_dtype("t17_h17_keys129_topk17", "t3_h3_keys40_topk129", "invalid_entries",
                           "all_invalid_rows", "small_head_dims", op="sparse_mla_attention")
    expected |= every_dtype("prefill_keys4096", "prefill_invalid_duplicates", preset="glm5",
                            op="sparse_mla_attention")
    assert_only(records, expected)
    dead = records["sparse_mla_attention/tiny/all_invalid_rows/bfloat16"]
    assert "non-finite values differ" in dead.reason    # lse -inf became finite


def test_sparse_attention_skipping_duplicate_indices_is_caught(hal_state):
    def dedupes(q, kv, indices, sm_scale, d_v):
        unique = indices.clone()
        for t in range(indices.shape[0]):
            seen = set()
            for j, v in enumerate(indices[t].tolist()):
                if v in seen:
                    unique[t, j] = -1
                seen.add(v)
        return ref.sparse_mla_attention(q, kv, unique, sm_scale, d_v)
    records = run(wrong_backend(hal_state, "dedupe", sparse_mla_attention=dedupes), "sparse_mla_attention")
    assert_only(records, every_dtype("duplicate_indices", op="sparse_mla_attention"))


def test_sparse_decode_reading_stale_positions_is_caught(hal_state):
    def capacity_bound(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v):
        capacity = block_table.shape[1] * kv_cache.shape[1]
        full = torch.full_like(context_lens, capacity)
        # every slot of the used blocks counts as written: positions up to the capacity are "valid"
        table = torch.where(block_table >= 0, block_table, 0).clamp(max=kv_cache.shape[0] - 1)
        return ref.sparse_mla_decode_paged(q, kv_cache, table, full, indices, sm_scale, d_v)
    records = run(wrong_backend(hal_state, "stale", sparse_mla_decode_paged=capacity_bound),
                  "sparse_mla_decode_paged")
    def stale_entry(case):
        q, cache, table, lens, idx = materialised(case)[:5]
        capacity = table.shape[1] * cache.shape[1]
        return bool(((idx >= lens.view(-1, 1, 1)) & (idx < capacity)).any())
    expected = {c.id for c in result_cases("sparse_mla_decode_paged") if stale_entry(c)}
    assert every_dtype("invalid_and_stale_entries", "all_invalid_rows", op="sparse_mla_decode_paged") <= expected
    assert_only(records, expected)


def minus_one_read_as(position: str):
    """A paged sparse decode that reads a -1 index as position 0, or as the sequence's last
    position (a kernel indexing the gathered sequence with -1, as Python does)."""
    def decode(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v):
        substitute = (torch.zeros_like(indices) if position == "zero"
                      else (context_lens - 1).view(-1, 1, 1).to(indices.dtype).expand_as(indices))
        return ref.sparse_mla_decode_paged(q, kv_cache, block_table, context_lens,
                                           torch.where(indices == -1, substitute, indices), sm_scale, d_v)
    return decode


@pytest.mark.parametrize("preset", ["tiny", pytest.param("glm5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("position", ["zero", "last"])
def test_sparse_decode_reading_minus_one_as_a_position_is_caught(hal_state, position, preset):
    name = wrong_backend(hal_state, f"minus1{position}", sparse_mla_decode_paged=minus_one_read_as(position))
    records = run(name, "sparse_mla_decode_paged", (preset,))

    def reads_a_row(case):   # a -1 entry in a sequence with a position to misread (context >= 1)
        lens, idx = materialised(case)[3:5]
        return bool(((idx == -1) & (lens.view(-1, 1, 1) >= 1)).any())
    expected = {c.id for c in result_cases("sparse_mla_decode_paged", preset) if reads_a_row(c)}
    if preset == "tiny":
        assert every_dtype("b3_n1_bs3", "invalid_and_stale_entries", "all_invalid_rows", "topk_exceeds_context",
                           op="sparse_mla_decode_paged") <= expected
    assert len(expected) >= 6
    assert_only(records, expected)


def test_dense_decode_without_the_causal_limit_for_mtp_is_caught(hal_state):
    def sees_everything(q, kv_cache, block_table, context_lens, sm_scale, d_v):
        outs = [ref.dense_mla_decode_paged(q[:, i:i + 1], kv_cache, block_table, context_lens, sm_scale, d_v)
                for i in range(q.shape[1])]
        return torch.cat([o for o, _ in outs], 1), torch.cat([l for _, l in outs], 1)
    records = run(wrong_backend(hal_state, "densefull", dense_mla_decode_paged=sees_everything),
                  "dense_mla_decode_paged", ("tiny", "glm5"))
    expected = every_dtype("mtp_n2_bs17", "mtp_n3_bs129", "max_table_fill", "shared_prefix",
                           "small_head_dims", "noncontig_views", op="dense_mla_decode_paged")
    expected |= every_dtype("mtp_n2_ctx1_700", preset="glm5", op="dense_mla_decode_paged")
    assert_only(records, expected)


# -- deliberately wrong backends: MoE --------------------------------------------------------
def test_moe_route_weighting_by_biased_scores_is_caught(hal_state):
    def biased_weights(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, score_func):
        weights, ids = ref.moe_route(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
                                      score_func)
        s = torch.softmax(logits.float(), -1) if score_func == "softmax" else torch.sigmoid(logits.float())
        c = s if bias is None else s + bias.float()
        w = c.gather(1, ids.long())
        if norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * routed_scaling_factor, ids
    records = run(wrong_backend(hal_state, "biasw", moe_route=biased_weights), "moe_route", ("tiny", "glm5"))
    # one expert normalises to 1 whatever its score; no bias, no difference
    unaffected = {"t1_e1_top1", "no_bias", "tied_logits", "empty_batch"}
    expected = {c.id for p in ("tiny", "glm5") for c in result_cases("moe_route", p) if c.name not in unaffected}
    assert_only(records, expected)
    r = records["moe_route/glm5/glm5_t5_e256_top8/bfloat16"]
    assert r.reason.startswith("out[0]: ") and "out[1]" not in r.reason   # the ids are right


def test_moe_route_ignoring_the_group_limit_is_caught(hal_state):
    def ungrouped(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, score_func):
        return ref.moe_route(logits, bias, top_k, 1, 1, routed_scaling_factor, norm_topk_prob, score_func)
    records = run(wrong_backend(hal_state, "nogroups", moe_route=ungrouped), "moe_route", ("tiny", "glm5"))
    # one-expert groups keep the best topk_group experts: the limit changes nothing there
    assert_only(records, every_dtype("grouped_e16_g4_tg2_top3", op="moe_route")
                | every_dtype("dsv32_t5_e256_g8_tg4_top8", preset="glm5", op="moe_route"))
    assert "outside the row's range" in records["moe_route/glm5/dsv32_t5_e256_g8_tg4_top8/float32"].reason


def test_moe_route_weights_follow_the_ids_the_backend_chose(hal_state):
    """Selection scores that tie exactly while the unbiased scores differ: any choice of ids
    is right, and its weights are those of the chosen experts."""
    s = torch.tensor([[0.9, 0.5, 0.7, 0.6]])
    logits = torch.logit(s.double()).float()
    bias = 1.0 - torch.sigmoid(logits.double()).float()[0]     # c = s + bias = 1 for every expert

    def other_two(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, score_func):
        chosen = ref.moe_route(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
                                      score_func)[1]
        ids = torch.tensor([[e for e in range(4) if e not in chosen[0].tolist()]], dtype=torch.int32)
        w = torch.sigmoid(logits.float()).gather(1, ids.long())
        return w / w.sum(-1, keepdim=True) * routed_scaling_factor, ids
    name = wrong_backend(hal_state, "othertwo", moe_route=other_two)

    def case(checks):
        return Case("moe_route", "tiny", "exact_selection_ties", torch.float32,
                    lambda g: (logits, bias, 2, 1, 1, 2.5, True, "sigmoid"), checks)
    r = runner.run_case(name, case(ROUTE_CHECKS))
    assert r.status == "pass", r.reason
    naive = runner.run_case(name, case({"out[0]": Close(dtype=torch.float32), "out[1]": ROUTE_IDS}))
    assert naive.status == "fail" and naive.reason.startswith("out[0]")   # the reference chose others


def test_moe_permute_breaking_the_stable_order_within_an_expert_is_caught(hal_state):
    def unstable(x, ids, num_experts):
        k = ids.shape[1]
        flat = ids.reshape(-1).long()
        keep = ((flat >= 0) & (flat < num_experts)).nonzero().flatten()
        key = flat[keep] * (flat.numel() + 1) + (flat.numel() - keep)    # descending flat index
        src = keep[torch.argsort(key)]
        counts = torch.bincount(flat[keep], minlength=num_experts).int()
        return x[src // k], counts, src.int()
    records = run(wrong_backend(hal_state, "unstable", moe_permute=unstable), "moe_permute", ("tiny", "glm5"))
    def crowded(case):
        x, ids, e = materialised(case)
        flat = ids.reshape(-1).long()
        flat = flat[(flat >= 0) & (flat < e)]
        return flat.numel() > 0 and int(torch.bincount(flat).max()) >= 2
    expected = {c.id for p in ("tiny", "glm5") for c in result_cases("moe_permute", p) if crowded(c)}
    assert every_dtype("crowded_expert", "duplicate_expert_in_row", op="moe_permute") <= expected
    assert_only(records, expected)
    assert "out[2]: " in records["moe_permute/tiny/crowded_expert/float32"].reason


def test_moe_unpermute_weighting_by_row_order_is_caught(hal_state):
    def slot_zero(y, src, weights):
        k = weights.shape[1]
        return ref.moe_unpermute(y, src, weights[:, :1].expand(-1, k).contiguous())
    records = run(wrong_backend(hal_state, "slotzero", moe_unpermute=slot_zero), "moe_unpermute")
    def uses_other_slots(case):
        y, src, weights = materialised(case)
        k = weights.shape[1]
        used = weights.reshape(-1)[src.long()] if src.numel() else torch.zeros(0)
        first = weights[:, 0].repeat_interleave(k)[src.long()] if src.numel() else torch.zeros(0)
        return bool((used != first).any())
    assert_only(records, {c.id for c in result_cases("moe_unpermute") if uses_other_slots(c)})


def test_grouped_gemm_ignoring_zero_row_experts_offsets_is_caught(hal_state):
    def compacted(x, w, tokens_per_expert):
        busy = tokens_per_expert > 0     # the weights of the i-th busy expert taken as w[i]
        counts = tokens_per_expert[busy]
        return ref.grouped_gemm(x, w[:counts.numel()], counts)
    records = run(wrong_backend(hal_state, "compacted", grouped_gemm=compacted), "grouped_gemm")
    def zero_before_busy(case):
        counts = materialised(case)[2].tolist()
        return any(c == 0 and any(later > 0 for later in counts[i + 1:]) for i, c in enumerate(counts))
    expected = {c.id for c in result_cases("grouped_gemm") if zero_before_busy(c)}
    assert every_dtype("zero_row_ends", "one_busy_expert", "noncontig_w", op="grouped_gemm") <= expected
    assert_only(records, expected)
