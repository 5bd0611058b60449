"""The cpu backend's MoE ops: native moe_permute / moe_unpermute (bit-exact permutation,
float32 accumulation), torch-backed moe_route and grouped_gemm, against the reference;
invalid indices raise InvalidInputError from the native code itself, before any write."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from glm5_hal import InvalidInputError, _C

from cpu_helpers import (FLOATS, TIERS, assert_close, chosen, cpu_impl, gen, isa_limit, native_view,  # noqa: F401
                         reference, tier)


def routed(tokens, k, experts, g, *, invalid=0.0, duplicates=False):
    """ids [T, k]: distinct experts per token, a fraction `invalid` replaced by -1 or >= E."""
    if experts >= k and not duplicates:
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, k, dtype=torch.int64)
    else:
        ids = torch.randint(0, experts, (tokens, k), generator=g)
    if invalid:
        drop = torch.rand(tokens, k, generator=g) < invalid
        ids[drop] = torch.where(torch.rand(int(drop.sum()), generator=g) < 0.5, -1, experts + 3)
    return ids.to(torch.int32)


def check_permute(x, ids, experts):
    xp, tpe, src = hal.ops.moe_permute(x, ids, experts)
    rp, rtpe, rsrc = hal.reference.moe_permute(x, ids, experts)
    assert torch.equal(tpe, rtpe) and torch.equal(src, rsrc)
    assert xp.dtype == x.dtype and torch.equal(xp, rp)  # a permutation: bit-exact
    return xp, tpe, src


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("tokens,k,experts,dim", [(1, 1, 1, 1), (17, 3, 8, 129), (64, 8, 256, 64), (5, 8, 4, 33)])
def test_permute_and_unpermute_match_reference(tier, dtype, tokens, k, experts, dim):
    g = gen("moe", tokens, k, experts, dim, str(dtype), tier)
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    ids = routed(tokens, k, experts, g, invalid=0.2)
    assert chosen("moe_permute", x, ids, experts) == "cpu.moe_permute"
    xp, tpe, src = check_permute(x, ids, experts)
    y = (xp.float() * 1.5 - 0.25).to(dtype)
    w = torch.rand(tokens, k, generator=g)
    assert chosen("moe_unpermute", y, src, w) == "cpu.moe_unpermute"
    assert_close(hal.ops.moe_unpermute(y, src, w), reference("moe_unpermute", y, src, w), dtype, widen=2)


def test_permute_edge_cases():
    g = gen("moe-edges")
    x = torch.randn(6, 16, generator=g)
    check_permute(x, torch.full((6, 2), -1, dtype=torch.int32), 4)                    # nothing valid: M = 0
    check_permute(x, torch.full((6, 2), 2, dtype=torch.int32), 4)                     # one expert, zero-row others
    check_permute(x, torch.tensor([[1, 1]] * 6, dtype=torch.int32), 4)                 # same expert twice per token
    check_permute(x, torch.tensor([[5, 2**31 - 1]] * 6, dtype=torch.int32), 4)         # experts of another rank
    check_permute(torch.randn(0, 16), torch.zeros(0, 3, dtype=torch.int32), 4)         # empty batch
    check_permute(x[:, ::2], routed(6, 2, 4, g), 4)                                    # strided x
    check_permute(torch.randn(16, 6, generator=g).t(), routed(6, 2, 4, g), 4)          # transposed x
    check_permute(x, routed(6, 4, 8, g).t().contiguous().t(), 8)                       # column-major ids
    check_permute(torch.randn(1, 8).expand(6, 8), routed(6, 2, 4, g), 4)               # row stride 0


def test_unpermute_several_rows_per_slot_and_tokens_without_rows(tier):
    g = gen("moe-dups", tier)
    y = torch.randn(7, 40, generator=g)
    src = torch.tensor([0, 0, 5, 1, 5, 5, 4], dtype=torch.int32)  # T=3, k=2: token 1 (slots 2, 3) gets none
    w = torch.rand(3, 2, generator=g)
    out = hal.ops.moe_unpermute(y, src, w)
    assert_close(out, reference("moe_unpermute", y, src, w), torch.float32, widen=2)
    assert (out[1] == 0).all()
    assert hal.ops.moe_unpermute(torch.randn(0, 40), torch.zeros(0, dtype=torch.int32), w).abs().sum() == 0


def test_unpermute_inverts_permute_with_unit_weights():
    g = gen("moe-roundtrip")
    x = torch.randn(33, 64, generator=g).bfloat16()
    ids = routed(33, 8, 256, g)
    xp, _, src = hal.ops.moe_permute(x, ids, 256)
    out = hal.ops.moe_unpermute(xp, src, torch.full((33, 8), 0.125))
    torch.testing.assert_close(out, x, rtol=0, atol=0)  # 8 * x / 8 is exact in float32, x in bf16


def test_native_permute_rejects_inconsistent_arguments():
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    tpe, src = torch.full((4,), -7, dtype=torch.int32), torch.full((8,), -7, dtype=torch.int32)
    bad_plans = [(-1, 2, 2, 4), (4, 0, 2, 4), (4, 2, -1, 4), (4, 2, 2, 0), (2**31, 2, 2, 4)]
    for tokens, k, stride, experts in bad_plans:
        with pytest.raises(InvalidInputError):
            _C.moe_permute_plan(native_view(tpe, size=(experts,)), src,
                                native_view(ids, size=(tokens, k), stride=(stride, 1)))
        assert (tpe == -7).all() and (src == -7).all()
    out = torch.full((3, 8), 9.0)
    for bad_src in ([0, 8, 1], [0, -1, 1], [2**31 - 1, 0, 0]):
        s = torch.tensor(bad_src, dtype=torch.int32)
        with pytest.raises(InvalidInputError, match="src"):
            _C.moe_permute_gather(out, x, s, 2, 1)
        assert (out == 9.0).all()
    with pytest.raises(InvalidInputError):
        _C.moe_permute_gather(native_view(out, size=(0, 8)), native_view(x, stride=(-8, 1)), src, 2, 1)


def test_native_unpermute_rejects_out_of_range_src_before_writing():
    y = torch.randn(3, 8)
    w = torch.rand(2, 2)
    out = torch.full((2, 8), 5.0)
    for bad in ([0, 4, 1], [-1, 0, 1], [3, 2, 2**31 - 1]):
        s = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(InvalidInputError, match="src"):
            _C.moe_unpermute(out, y, s, w, 1)
        assert (out == 5.0).all()
        # the backend function alone (no glm5_hal.ops checks in front) raises too
        with pytest.raises(InvalidInputError):
            cpu_impl("moe_unpermute")(y, s, w)
    ok = torch.tensor([0, 1, 2], dtype=torch.int32)
    for args in [(y, ok, native_view(w, size=(2, 0))),            # k = 0
                 (native_view(y, stride=(-1, 1)), ok, w),        # stride < 0
                 (native_view(y, dtype=5), ok, w),               # int64 code as y dtype
                 (native_view(y, size=(-3, 8)), ok, w)]:         # M < 0
        with pytest.raises(InvalidInputError):
            _C.moe_unpermute(out, *args, 1)
        assert (out == 5.0).all()


def test_public_op_rejects_bad_src():
    with pytest.raises(InvalidInputError, match="src"):
        hal.ops.moe_unpermute(torch.randn(2, 4), torch.tensor([0, 9], dtype=torch.int32), torch.rand(2, 2))


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 20), k=st.integers(1, 9), experts=st.integers(1, 40), dim=st.integers(1, 140),
       dtype=st.sampled_from(FLOATS), tier_=st.sampled_from(TIERS), seed=st.integers(0, 2**31 - 1),
       lo=st.integers(-3, 0), hi_extra=st.integers(0, 3))
def test_property_permute_unpermute(tokens, k, experts, dim, dtype, tier_, seed, lo, hi_extra):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(lo, experts + hi_extra, (tokens, k), generator=g, dtype=torch.int32)  # -1s, >= E, repeats
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    with isa_limit(tier_):
        xp, tpe, src = cpu_impl("moe_permute")(x, ids, experts)
        rp, rtpe, rsrc = hal.reference.moe_permute(x, ids, experts)
        assert torch.equal(xp, rp) and torch.equal(tpe, rtpe) and torch.equal(src, rsrc)
        w = torch.randn(tokens, k, generator=g)
        assert_close(cpu_impl("moe_unpermute")(xp, src, w), reference("moe_unpermute", xp, src, w), dtype, widen=4)
        if tokens:
            bad = src.clone() if src.numel() else torch.zeros(1, dtype=torch.int32)
            bad[torch.randint(0, bad.numel(), (1,), generator=g)] = tokens * k + int(torch.randint(0, 5, (1,)))
            yb = torch.randn(bad.numel(), dim).to(dtype)
            with pytest.raises(InvalidInputError):
                cpu_impl("moe_unpermute")(yb, bad, w)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_grouped_gemm_matches_reference(dtype):
    g = gen("gg", str(dtype))
    counts = torch.tensor([3, 0, 17, 1, 0, 9], dtype=torch.int32)   # zero-row experts included
    x = torch.randn(int(counts.sum()), 40, generator=g).to(dtype)
    w = torch.randn(6, 24, 40, generator=g).to(dtype)
    assert chosen("grouped_gemm", x, w, counts) == "cpu.grouped_gemm"
    assert_close(hal.ops.grouped_gemm(x, w, counts), reference("grouped_gemm", x, w, counts), dtype, widen=4)
    empty = hal.ops.grouped_gemm(torch.randn(0, 40).to(dtype), w, torch.zeros(6, dtype=torch.int32))
    assert empty.shape == (0, 24)


def _gemm_float_tiers() -> list[int]:
    """The qgemm tier limits at which the bfloat16 path changes tier (each tested once)."""
    previous, limits, seen = _C.qgemm_set_isa_limit(4), [], set()
    try:
        for limit in range(_C.qgemm_max_isa(), -1, -1):
            _C.qgemm_set_isa_limit(limit)
            if _C.qgemm_float_isa() not in seen:
                seen.add(_C.qgemm_float_isa())
                limits.append(limit)
    finally:
        _C.qgemm_set_isa_limit(previous)
    return limits


@pytest.mark.parametrize("gemm_limit", _gemm_float_tiers())
@pytest.mark.parametrize("counts,n,k", [
    ((0, 1, 3, 33), 13, 70),   # rows per expert 0, 1, 3, 33: every row tail of a 4-row tile
    ((2, 7, 4), 6, 32),        # whole 6-row weight tiles, one whole 32-wide K step
    ((130, 5), 11, 40),        # 130 rows: several row chunks; N = 6 + 5
    ((6, 0), 29, 95),          # N = 4 * 6 + 5, K = 2 * 32 + 31
    ((3, 2), 9, 0),            # K = 0: zeros
])
def test_bf16_grouped_gemm_tails_match_reference(gemm_limit, counts, n, k):
    """The native bfloat16 grouped_gemm on each of its tile tiers (on AVX-512 BF16 the 4 x 6
    dot-product tiles over rows read in place) with tails in every dim, x rows strided and
    unaligned, against the float32-accumulating reference."""
    g = gen("gg-tails", counts, n, k)
    tpe = torch.tensor(counts, dtype=torch.int32)
    wide = torch.randn(int(tpe.sum()), k + 3, generator=g).bfloat16()
    x = wide[:, 1:k + 1]   # row stride k + 3, first element off alignment
    w = (torch.randn(len(counts), n, k, generator=g) / max(k, 1) ** 0.5).bfloat16()
    with isa_limit(gemm_limit, _C.qgemm_set_isa_limit):
        out = hal.ops.grouped_gemm(x, w, tpe)
    assert_close(out, reference("grouped_gemm", x, w, tpe), torch.bfloat16, widen=4)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n_group,topk_group,score_func", [(1, 1, "sigmoid"), (8, 4, "sigmoid"), (1, 1, "softmax")])
def test_moe_route_matches_reference(dtype, n_group, topk_group, score_func):
    g = gen("route", str(dtype), n_group, score_func)
    logits = torch.randn(19, 256, generator=g).to(dtype)
    bias = torch.randn(256, generator=g) * 0.1
    args = (logits, bias, 8, n_group, topk_group, 2.5, True, score_func)
    assert chosen("moe_route", *args) == "cpu.moe_route"
    w, ids = hal.ops.moe_route(*args)
    rw, rids = hal.reference.moe_route(*args)   # same float32 scores: same selection
    assert torch.equal(ids.sort(-1).values, rids.sort(-1).values)
    torch.testing.assert_close(w.gather(1, ids.sort(-1).indices), rw.gather(1, rids.sort(-1).indices))
    w2, _ = hal.ops.moe_route(logits, None, 8, n_group, topk_group, 1.0, False, score_func)
    assert w2.dtype == torch.float32


def check_route(logits, bias, top_k, n_group, topk_group, scale, norm, score_func):
    """The native router against the float64 reference by the top-k rule: distinct ids, each
    chosen expert's biased score >= the k-th best (within float32 rounding), weights = the
    unbiased scores of the chosen ids, normalised and scaled."""
    w, ids = cpu_impl("moe_route")(logits, bias, top_k, n_group, topk_group, scale, norm, score_func)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (logits.shape[0], top_k)
    lf = logits.double()
    s = torch.softmax(lf, -1) if score_func == "softmax" else torch.sigmoid(lf)
    c = s if bias is None else s + bias.double()
    if n_group > 1:
        t, e = c.shape
        grouped = c.view(t, n_group, e // n_group)
        gs = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)
        kth_group = gs.topk(topk_group, dim=-1).values[:, -1:]
        chosen_groups = ids.long() // (e // n_group)
        assert (gs.gather(1, chosen_groups) >= kth_group - 1e-5).all()
        # tied groups: the kernel keeps the lower-indexed ones; judge experts within the groups
        # it drew from (an unchosen kept group holds no expert above the chosen ones)
        used = torch.zeros(t, n_group, dtype=torch.bool).scatter_(1, chosen_groups, True)
        c = grouped.masked_fill(~used.unsqueeze(-1), float("-inf")).view(t, e)
    for row in ids.tolist():
        assert len(set(row)) == top_k
    kth = c.topk(top_k, dim=-1).values[:, -1:]
    assert (c.gather(1, ids.long()) >= kth - 1e-5).all()
    want = s.gather(1, ids.long())
    if norm:
        want = want / (want.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w.double(), want * scale, rtol=1e-5, atol=1e-6)
    # ordered by descending biased score
    picked = c.gather(1, ids.long())
    assert (picked[:, :-1] >= picked[:, 1:] - 1e-5).all()


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 12), groups=st.sampled_from([(1, 1), (4, 2), (8, 4), (8, 8)]), per=st.integers(1, 9),
       dtype=st.sampled_from(FLOATS), score_func=st.sampled_from(["sigmoid", "softmax"]), norm=st.booleans(),
       with_bias=st.booleans(), coarse=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_property_moe_route(tokens, groups, per, dtype, score_func, norm, with_bias, coarse, seed, data):
    n_group, topk_group = groups
    experts = n_group * per
    top_k = data.draw(st.integers(1, topk_group * per))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    if coarse:  # few distinct values: exact ties everywhere
        logits = logits.round()
    logits = logits.to(dtype)
    bias = (torch.randn(experts, generator=g) * 0.1).round(decimals=1) if with_bias else None
    check_route(logits, bias, top_k, n_group, topk_group, 2.5, norm, score_func)


def test_moe_route_edges():
    g = gen("route-edges")
    logits = torch.randn(12, 64, generator=g)[:, ::2]                    # strided experts
    check_route(logits, None, 4, 1, 1, 1.0, True, "sigmoid")
    check_route(torch.randn(20, 5, generator=g).t(), torch.zeros(20), 3, 1, 1, 1.0, True, "sigmoid")  # transposed
    w, ids = hal.ops.moe_route(torch.zeros(0, 8), None, 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    nan_logits = torch.randn(2, 8, generator=g)
    nan_logits[0, 3] = float("nan")
    w, ids = hal.ops.moe_route(nan_logits, None, 2)                         # defined, no crash
    assert ids.shape == (2, 2) and (ids >= 0).all() and (ids < 8).all()
    w, ids = hal.ops.moe_route(torch.zeros(1, 6), None, 6)                  # all tied, every expert
    assert sorted(ids[0].tolist()) == list(range(6))


def test_native_route_rejects_bad_arguments():
    logits = torch.randn(2, 8)
    w = torch.full((2, 2), 3.0)
    ids = torch.full((2, 2), -5, dtype=torch.int32)
    bad = [dict(top_k=0), dict(top_k=9), dict(n_group=3), dict(n_group=2, topk_group=3), dict(experts=0),
           dict(ld=4), dict(stride=-1), dict(scale=float("inf")), dict(n_group=4, topk_group=1, top_k=3)]
    for kw in bad:
        a = dict(ld=0, tokens=2, experts=8, stride=8, top_k=2, n_group=1, topk_group=1, scale=1.0) | kw
        outputs = dict(size=(a["tokens"], a["top_k"]), stride=(a["top_k"], 1))
        with pytest.raises(InvalidInputError):
            _C.moe_route(native_view(w, **outputs), native_view(ids, **outputs),
                         native_view(logits, size=(a["tokens"], a["experts"]), stride=(a["stride"], 1), dtype=a["ld"]),
                         None, a["n_group"], a["topk_group"], a["scale"], True, False, 1)
        assert (w == 3.0).all() and (ids == -5).all()
