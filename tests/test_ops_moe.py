"""MoE ops: moe_route, moe_permute, moe_unpermute, grouped_gemm against independent
constructions written here, their composition into a MoE layer, autograd, the input
contract, and torch integration (opcheck, torch.compile)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from conftest import assert_invalid
from glm5_hal import reference as ref

REPO = Path(__file__).resolve().parents[1]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# one rounding of the output on top of float32 accumulation
OUT_TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ids_tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), -1)


# -- moe_route ------------------------------------------------------------------------------
def route_by_hand(logits, bias, top_k, n_group, topk_group, factor, norm, score_func):
    """docs/ops/moe.md steps 1-7, one token at a time in float64 Python arithmetic.
    Returns one {expert: weight} dict per token."""
    T, E = logits.shape
    per_group = E // n_group
    result = []
    for row in logits.double().tolist():
        if score_func == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            e = [math.exp(v - m) for v in row]
            s = [v / sum(e) for v in e]
        c = [s[i] + (0.0 if bias is None else float(bias[i])) for i in range(E)]
        if n_group > 1:
            group_score = [sum(sorted(c[g * per_group:(g + 1) * per_group], reverse=True)[:2])
                           for g in range(n_group)]
            kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
            c = [c[i] if i // per_group in kept else -math.inf for i in range(E)]
        chosen = sorted(range(E), key=lambda i: -c[i])[:top_k]
        w = [s[i] for i in chosen]
        if norm:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        result.append({i: v * factor for i, v in zip(chosen, w)})
    return result


ROUTE_CASES = [
    # T, E, top_k, n_group, topk_group, factor, norm, score_func, with_bias
    (9, 16, 4, 1, 1, 1.0, True, "sigmoid", False),
    (9, 16, 4, 1, 1, 2.5, True, "sigmoid", True),      # GLM-5 style (n_group = 1)
    (7, 64, 8, 8, 4, 2.5, True, "sigmoid", True),      # DeepSeek-V3 style groups
    (5, 24, 3, 3, 2, 1.0, False, "sigmoid", True),
    (6, 12, 2, 4, 1, 1.5, True, "softmax", False),
    (6, 12, 5, 6, 3, 1.0, False, "softmax", True),
    (4, 6, 3, 6, 4, 1.0, True, "sigmoid", True),       # one expert per group: top-1 group score
    (1, 1, 1, 1, 1, 1.0, True, "sigmoid", False),
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_route_matches_hand_construction(case):
    T, E, top_k, n_group, topk_group, factor, norm, score_func, with_bias = case
    g = gen(E * 100 + top_k)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if with_bias else None
    weights, ids = hal.ops.moe_route(logits, bias, top_k, n_group, topk_group, factor, norm, score_func)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (T, top_k)
    expected = route_by_hand(logits, bias, top_k, n_group, topk_group, factor, norm, score_func)
    for t in range(T):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(expected[t]), f"token {t}"
        for e, w in expected[t].items():
            assert got[e] == pytest.approx(w, rel=2e-6, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_route_low_precision_logits_score_in_float32(dtype):
    g = gen(3)
    logits = torch.randn(11, 32, generator=g).to(dtype)
    bias = (torch.randn(32, generator=g) * 0.1).to(dtype)
    weights, ids = hal.ops.moe_route(logits, bias, 6, 4, 2, 2.5)
    expected = route_by_hand(logits.float(), bias.float(), 6, 4, 2, 2.5, True, "sigmoid")
    for t in range(11):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert got.keys() == expected[t].keys()
        assert got == pytest.approx(expected[t], rel=2e-6)


@settings(max_examples=60, deadline=None)
@given(n_group=st.integers(2, 8), per_group=st.integers(1, 6), data=st.data(),
       T=st.integers(1, 12), seed=st.integers(0, 2**31 - 1), with_bias=st.booleans())
def test_moe_route_never_picks_a_masked_group(n_group, per_group, data, T, seed, with_bias):
    E = n_group * per_group
    topk_group = data.draw(st.integers(1, n_group))
    top_k = data.draw(st.integers(1, topk_group * per_group))
    g = gen(seed)
    logits = torch.randn(T, E, generator=g) * 3
    bias = torch.randn(E, generator=g) if with_bias else None
    weights, ids = hal.ops.moe_route(logits, bias, top_k, n_group, topk_group)
    c = torch.sigmoid(logits.double()) + (0 if bias is None else bias.double())
    group_scores = c.view(T, n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    cutoff = group_scores.topk(topk_group, dim=-1).values[:, -1:]
    chosen_groups = ids.long() // per_group
    # within float32 rounding of the boundary group score (ties may go either way)
    assert bool((group_scores.gather(1, chosen_groups) >= cutoff - 1e-6).all())
    for t in range(T):
        row = ids[t].tolist()
        assert len(set(row)) == top_k and all(0 <= e < E for e in row)
        assert len(set(chosen_groups[t].tolist())) <= topk_group
    torch.testing.assert_close(weights.sum(-1), torch.ones(T), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factor", [1.0, 2.5, 0.25])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_moe_route_normalised_weights_sum_to_scaling_factor(factor, score_func):
    logits = torch.randn(13, 32, generator=gen(7))
    weights, _ = hal.ops.moe_route(logits, torch.zeros(32), 8, 4, 2, factor, True, score_func)
    torch.testing.assert_close(weights.sum(-1), torch.full((13,), factor), rtol=2e-6, atol=1e-6)
    assert bool((weights > 0).all())


def test_moe_route_bias_steers_selection_but_weights_are_unbiased_scores():
    g = gen(11)
    logits = torch.randn(10, 16, generator=g)
    scores = torch.sigmoid(logits)
    favoured = [3, 7, 12]
    bias = torch.zeros(16)
    bias[favoured] = 10.0  # dominates every sigmoid difference
    unbiased_w, unbiased_ids = hal.ops.moe_route(logits, None, 3, norm_topk_prob=False)
    weights, ids = hal.ops.moe_route(logits, bias, 3, norm_topk_prob=False)
    for t in range(10):
        assert sorted(ids[t].tolist()) == favoured
    assert any(sorted(r) != favoured for r in unbiased_ids.tolist())  # the bias did change something
    torch.testing.assert_close(weights, scores.gather(1, ids.long()), rtol=0, atol=0)
    torch.testing.assert_close(unbiased_w, scores.gather(1, unbiased_ids.long()), rtol=0, atol=0)
    normed, ids_n = hal.ops.moe_route(logits, bias, 3, routed_scaling_factor=2.5)
    chosen = scores.gather(1, ids_n.long())
    torch.testing.assert_close(normed, chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * 2.5)


def test_moe_route_all_zero_scores_normalise_to_zero_not_nan():
    # softmax over many experts with one dominant logit underflows the rest to exactly 0
    logits = torch.full((2, 8), -200.0)
    logits[:, 0] = 0.0
    bias = torch.zeros(8)
    bias[1:3] = 5.0  # select experts whose scores are exactly 0
    weights, ids = hal.ops.moe_route(logits, bias, 2, score_func="softmax")
    assert sorted(ids[0].tolist()) == [1, 2]
    assert torch.equal(weights, torch.zeros(2, 2))


def test_moe_route_empty_batch():
    weights, ids = hal.ops.moe_route(torch.empty(0, 16), torch.zeros(16), 4, 4, 2)
    assert weights.shape == ids.shape == (0, 4)


# -- moe_permute / moe_unpermute ----------------------------------------------------------------
def permute_by_hand(ids, num_experts):
    """Expert by expert, flat index by flat index: the row order the contract specifies."""
    T, k = ids.shape
    flat = ids.flatten().tolist()
    src = [f for e in range(num_experts) for f in range(T * k) if flat[f] == e]
    counts = [flat.count(e) for e in range(num_experts)]
    return src, counts


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,k,E,low,high", [
    (13, 4, 8, 0, 8),        # all valid
    (13, 4, 8, -1, 8),       # with -1 padding
    (17, 3, 5, -3, 9),       # other ranks' experts (>= E) and arbitrary negatives
    (9, 2, 16, 0, 3),        # most experts get zero rows
    (5, 2, 4, -2, 0),        # nothing valid: M = 0
    (0, 8, 4, 0, 4),         # empty batch
    (1, 1, 1, 0, 1),
])
def test_moe_permute_order_matches_hand_construction(dtype, T, k, E, low, high):
    g = gen(T * 31 + k)
    x = torch.randn(T, 6, generator=g).to(dtype)
    ids = torch.randint(low, high, (T, k), generator=g, dtype=torch.int32)
    x_perm, counts, src = hal.ops.moe_permute(x, ids, E)
    want_src, want_counts = permute_by_hand(ids, E)
    assert src.dtype == counts.dtype == torch.int32 and x_perm.dtype == dtype
    assert src.tolist() == want_src
    assert counts.tolist() == want_counts
    assert torch.equal(x_perm, x[torch.tensor(want_src, dtype=torch.long) // k].reshape(-1, 6))


def test_moe_permute_rows_are_stable_within_an_expert():
    ids = ids_tensor([[2, 0], [0, 2], [2, 2], [1, 0]])
    x = torch.arange(4.0).unsqueeze(1).expand(4, 3).contiguous()
    x_perm, counts, src = hal.ops.moe_permute(x, ids, 3)
    assert src.tolist() == [1, 2, 7, 6, 0, 3, 4, 5]
    assert counts.tolist() == [3, 1, 4]
    assert x_perm[:, 0].tolist() == [0.0, 1.0, 3.0, 3.0, 0.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize("dtype", FLOATS)
def test_unpermute_of_permute_with_unit_weights_is_k_times_x(dtype):
    g = gen(5)
    T, k, E = 21, 4, 8
    x = torch.randn(T, 32, generator=g).to(dtype)
    # distinct experts per token, as a router produces
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    x_perm, _, src = hal.ops.moe_permute(x, ids, E)
    out = hal.ops.moe_unpermute(x_perm, src, torch.ones(T, k))
    rtol, atol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double(), (x.double() * k).to(dtype).double(), rtol=rtol, atol=atol)


def test_unpermute_of_permute_drops_invalid_ids_consistently():
    g = gen(6)
    T, k, E = 19, 3, 6
    x = torch.randn(T, 8, generator=g)
    ids = torch.randint(-2, E + 3, (T, k), generator=g, dtype=torch.int32)
    ids[0] = -1  # a token with no valid expert at all
    x_perm, counts, src = hal.ops.moe_permute(x, ids, E)
    valid = ((ids >= 0) & (ids < E))
    assert x_perm.shape[0] == int(valid.sum()) == int(counts.sum())
    out = hal.ops.moe_unpermute(x_perm, src, torch.ones(T, k))
    torch.testing.assert_close(out, x * valid.sum(1, keepdim=True).float())
    assert torch.equal(out[0], torch.zeros(8))


def unpermute_by_hand(y, src, weights):
    T, k = weights.shape
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    for r, f in enumerate(src.tolist()):
        out[f // k] += weights[f // k, f % k].double() * y[r].double()
    return out


@pytest.mark.parametrize("dtype", FLOATS)
def test_moe_unpermute_matches_hand_sum(dtype):
    g = gen(8)
    T, k, D = 11, 3, 40
    src = torch.randperm(T * k, generator=g)[:25].int()  # some (t, j) without a row
    y = torch.randn(25, D, generator=g).to(dtype)
    weights = torch.rand(T, k, generator=g)
    out = hal.ops.moe_unpermute(y, src, weights)
    assert out.dtype == dtype and out.shape == (T, D)
    expected = unpermute_by_hand(y, src, weights)
    rtol, atol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=rtol, atol=atol)
    missing = set(range(T)) - {f // k for f in src.tolist()}
    for t in missing:
        assert torch.equal(out[t], torch.zeros(D, dtype=dtype))


def test_moe_unpermute_reference_accumulates_in_float64_when_given_float64():
    g = gen(9)
    y = torch.randn(6, 4, generator=g, dtype=torch.float64) * 1e8
    y[1] = -y[0] + 1e-3  # cancels to 1e-3 only in float64
    src = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32)
    out = ref.moe_unpermute(y, src, torch.ones(3, 2, dtype=torch.float64))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, unpermute_by_hand(y, src, torch.ones(3, 2)), rtol=0, atol=1e-9)


# -- grouped_gemm ---------------------------------------------------------------------------
def grouped_gemm_by_hand(x, w, counts):
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x[start:start + n].double() @ w[e].double().T)
        start += n
    return torch.cat(out) if out else torch.zeros(0, w.shape[1], dtype=torch.float64)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0], [7], [0, 4, 0, 0, 2, 0], [1, 1, 1, 1, 1]])
def test_grouped_gemm_matches_per_expert_loop(dtype, counts):
    g = gen(sum(counts) * 7 + len(counts))
    K, N = 24, 10
    x = torch.randn(sum(counts), K, generator=g).to(dtype)
    w = (torch.randn(len(counts), N, K, generator=g) / K ** 0.5).to(dtype)
    out = hal.ops.grouped_gemm(x, w, torch.tensor(counts, dtype=torch.int32))
    assert out.dtype == dtype and out.shape == (sum(counts), N)
    rtol, atol = OUT_TOL[dtype]
    expected = grouped_gemm_by_hand(x, w, counts)
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=rtol, atol=atol)


# -- the MoE layer ----------------------------------------------------------------------------
@pytest.mark.parametrize("local_experts", [8, 4], ids=["all-local", "half-local"])
def test_moe_layer_composition_equals_dense_per_token_computation(local_experts):
    """route -> permute -> grouped_gemm(w13) -> silu * up -> grouped_gemm(w2) -> unpermute.
    With local_experts < E the permute keeps only this rank's experts, as expert parallelism does."""
    g = gen(12)
    T, D, inter, E, top_k = 9, 16, 12, 8, 3
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    w13 = torch.randn(local_experts, 2 * inter, D, generator=g) / D ** 0.5
    w2 = torch.randn(local_experts, D, inter, generator=g) / inter ** 0.5

    weights, ids = hal.ops.moe_route(logits, bias, top_k, 4, 2, 2.5)
    x_perm, counts, src = hal.ops.moe_permute(x, ids, local_experts)
    h = hal.ops.grouped_gemm(x_perm, w13, counts)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = hal.ops.grouped_gemm(act, w2, counts)
    out = hal.ops.moe_unpermute(y, src, weights)

    expected = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(top_k):
            e = int(ids[t, j])
            if e >= local_experts:
                continue
            hidden = w13[e].double() @ x[t].double()
            expert_out = w2[e].double() @ (F.silu(hidden[:inter]) * hidden[inter:])
            expected[t] += float(weights[t, j]) * expert_out
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# -- autograd ---------------------------------------------------------------------------------
def grads(fn, inputs, cotangents):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o, c in zip(outs, cotangents) if c is not None],
                            [c for c in cotangents if c is not None])
    return [leaf.grad for leaf in leaves]


def test_moe_permute_gradient_matches_reference():
    g = gen(13)
    x = torch.randn(7, 5, generator=g)
    ids = torch.randint(-1, 4, (7, 3), generator=g, dtype=torch.int32)
    M = int(((ids >= 0) & (ids < 4)).sum())
    cot = torch.randn(M, 5, generator=g)
    got = grads(lambda a: hal.ops.moe_permute(a, ids, 4), [x], [cot])
    want = grads(lambda a: ref.moe_permute(a, ids, 4), [x], [cot])
    torch.testing.assert_close(got[0], want[0])
    assert got[0].abs().sum() > 0


def test_moe_unpermute_gradient_matches_reference_and_gradcheck():
    g = gen(14)
    T, k = 6, 2
    src = torch.randperm(T * k, generator=g)[:9].int()
    y = torch.randn(9, 4, generator=g)
    weights = torch.rand(T, k, generator=g)
    cot = torch.randn(T, 4, generator=g)
    got = grads(lambda a, b: hal.ops.moe_unpermute(a, src, b), [y, weights], [cot])
    want = grads(lambda a, b: ref.moe_unpermute(a, src, b), [y, weights], [cot])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda a, b: ref.moe_unpermute(a, src, b),
                                    (y.double().requires_grad_(), weights.double().requires_grad_()))


def test_grouped_gemm_gradient_matches_reference_and_gradcheck():
    g = gen(15)
    counts = torch.tensor([2, 0, 3], dtype=torch.int32)
    x = torch.randn(5, 6, generator=g)
    w = torch.randn(3, 4, 6, generator=g)
    cot = torch.randn(5, 4, generator=g)
    got = grads(lambda a, b: hal.ops.grouped_gemm(a, b, counts), [x, w], [cot])
    want = grads(lambda a, b: ref.grouped_gemm(a, b, counts), [x, w], [cot])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.equal(got[1][1], torch.zeros(4, 6))  # the zero-row expert gets no gradient
    assert torch.autograd.gradcheck(lambda a, b: ref.grouped_gemm(a, b, counts),
                                    (x.double().requires_grad_(), w.double().requires_grad_()))


def test_moe_layer_trains_end_to_end_through_the_ops():
    g = gen(16)
    T, D, E = 6, 8, 4
    x = torch.randn(T, D, generator=g, requires_grad=True)
    w = torch.randn(E, D, D, generator=g, requires_grad=True)
    logits = torch.randn(T, E, generator=g)
    weights, ids = hal.ops.moe_route(logits, None, 2)
    weights.requires_grad_()
    x_perm, counts, src = hal.ops.moe_permute(x, ids, E)
    out = hal.ops.moe_unpermute(hal.ops.grouped_gemm(x_perm, w, counts), src, weights)
    out.square().sum().backward()
    xr, wr, weights_r = (t.detach().clone().requires_grad_() for t in (x, w, weights))
    xp, c, s = ref.moe_permute(xr, ids, E)
    ref.moe_unpermute(ref.grouped_gemm(xp, wr, c), s, weights_r).square().sum().backward()
    for a, b in ((x, xr), (w, wr), (weights, weights_r)):
        torch.testing.assert_close(a.grad, b.grad)


# -- the input contract -----------------------------------------------------------------------
def route_args(**over):
    args = dict(logits=torch.randn(4, 16), bias=torch.zeros(16), top_k=4, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, norm_topk_prob=True, score_func="sigmoid")
    args.update(over)
    return tuple(args.values())


BAD_ROUTE = [
    (dict(logits=torch.randn(4, 16).int()), "logits", "dtype float32 or float16 or bfloat16"),
    (dict(logits=torch.randn(64)), "logits", "a 2-d tensor"),
    (dict(logits=torch.randn(4, 0), bias=None, n_group=1, topk_group=1), "logits", "at least one expert"),
    (dict(bias=torch.zeros(15)), "bias", "shape [16]"),
    (dict(bias=torch.zeros(16, dtype=torch.int32)), "bias", "dtype float32"),
    (dict(bias=torch.zeros(16, device="meta")), "bias", "a tensor on cpu"),
    (dict(n_group=3), "n_group", "a divisor of the expert count 16"),
    (dict(n_group=0), "n_group", "an int >= 1"),
    (dict(topk_group=5), "topk_group", "an int in [1, n_group=4]"),
    (dict(topk_group=0), "topk_group", "an int >= 1"),
    (dict(top_k=9), "top_k", "an int in [1, 8]"),
    (dict(top_k=0), "top_k", "an int >= 1"),
    (dict(top_k=2.0), "top_k", "an int"),
    (dict(n_group=1, topk_group=1, top_k=17), "top_k", "an int in [1, 16]"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor", "a finite number"),
    (dict(norm_topk_prob=1), "norm_topk_prob", "a bool"),
    (dict(score_func="relu"), "score_func", "one of ['sigmoid', 'softmax']"),
]

BAD_PERMUTE = [
    ((torch.randn(4, 8).int(), ids_tensor([[0]] * 4), 4), "x", "dtype float32"),
    ((torch.randn(4, 8), ids_tensor([[0]] * 4).long(), 4), "ids", "dtype int32"),
    ((torch.randn(4, 8), ids_tensor([[0]] * 3), 4), "ids", "expected shape [4, "),
    ((torch.randn(4, 8), torch.zeros(4, 0, dtype=torch.int32), 4), "ids", "k >= 1"),
    ((torch.randn(4, 8), ids_tensor([[0]] * 4), 0), "num_experts", "an int >= 1"),
    ((torch.randn(4, 8), ids_tensor([[0]] * 4).to("meta"), 4), "ids", "a tensor on cpu"),
]

BAD_UNPERMUTE = [
    ((torch.randn(3, 8), torch.tensor([0, 1, 6], dtype=torch.int32), torch.ones(3, 2)),
     "src", "values in [0, 6)"),
    ((torch.randn(3, 8), torch.tensor([0, -1, 2], dtype=torch.int32), torch.ones(3, 2)),
     "src", "values in [0, 6)"),
    ((torch.randn(3, 8), torch.tensor([0, 1], dtype=torch.int32), torch.ones(3, 2)), "src", "shape [3]"),
    ((torch.randn(3, 8), torch.tensor([0, 1, 2]), torch.ones(3, 2)), "src", "dtype int32"),
    ((torch.randn(3, 8), torch.tensor([0, 1, 2], dtype=torch.int32), torch.ones(3, 2).bfloat16()),
     "weights", "dtype float32"),
    ((torch.randn(3, 8), torch.tensor([0, 1, 2], dtype=torch.int32), torch.ones(6)), "weights", "a 2-d tensor"),
    ((torch.randn(3, 8).double(), torch.tensor([0, 1, 2], dtype=torch.int32), torch.ones(3, 2)), "y", "dtype"),
]

BAD_GEMM = [
    ((torch.randn(5, 6), torch.randn(2, 4, 6), torch.tensor([2, 2], dtype=torch.int32)),
     "tokens_per_expert", "counts summing to 5"),
    ((torch.randn(5, 6), torch.randn(2, 4, 6), torch.tensor([7, -2], dtype=torch.int32)),
     "tokens_per_expert", "counts >= 0"),
    ((torch.randn(5, 6), torch.randn(2, 4, 6), torch.tensor([5, 0, 0], dtype=torch.int32)),
     "tokens_per_expert", "shape [2]"),
    ((torch.randn(5, 6), torch.randn(2, 4, 6), torch.tensor([5, 0])), "tokens_per_expert", "dtype int32"),
    ((torch.randn(5, 6), torch.randn(2, 4, 7), torch.tensor([5, 0], dtype=torch.int32)), "w", "got shape [2, 4, 7]"),
    ((torch.randn(5, 6), torch.randn(2, 4, 6).bfloat16(), torch.tensor([5, 0], dtype=torch.int32)),
     "w", "dtype float32 (the dtype of 'x')"),
    ((torch.randn(5, 6), torch.randn(4, 6), torch.tensor([5], dtype=torch.int32)), "w", "a 3-d tensor"),
    ((torch.randn(5, 6), torch.randn(0, 4, 6), torch.zeros(0, dtype=torch.int32)),
     "tokens_per_expert", "counts summing to 5"),
]


@pytest.mark.parametrize("over,arg,expected", BAD_ROUTE)
def test_moe_route_bad_input(over, arg, expected):
    assert_invalid(hal.ops.moe_route, route_args(**over), "moe_route", arg, expected)


@pytest.mark.parametrize("args,arg,expected", BAD_PERMUTE)
def test_moe_permute_bad_input(args, arg, expected):
    assert_invalid(hal.ops.moe_permute, args, "moe_permute", arg, expected)


@pytest.mark.parametrize("args,arg,expected", BAD_UNPERMUTE)
def test_moe_unpermute_bad_input(args, arg, expected):
    assert_invalid(hal.ops.moe_unpermute, args, "moe_unpermute", arg, expected)


@pytest.mark.parametrize("args,arg,expected", BAD_GEMM)
def test_grouped_gemm_bad_input(args, arg, expected):
    assert_invalid(hal.ops.grouped_gemm, args, "grouped_gemm", arg, expected)


# -- torch integration ----------------------------------------------------------------------
def sample_args():
    g = gen(17)
    ids = ids_tensor([[1, 3], [0, -1], [3, 2], [5, 1]])
    x = torch.randn(4, 8, generator=g)
    _, _, src = ref.moe_permute(x, ids, 4)
    return {
        "moe_route": (torch.randn(4, 16, generator=g), torch.randn(16, generator=g), 4, 4, 2, 2.5, True, "sigmoid"),
        "moe_permute": (x, ids, 4),
        "moe_unpermute": (torch.randn(src.shape[0], 8, generator=g), src, torch.rand(4, 2, generator=g)),
        "grouped_gemm": (torch.randn(6, 8, generator=g), torch.randn(3, 5, 8, generator=g),
                         torch.tensor([2, 0, 4], dtype=torch.int32)),
    }


@pytest.mark.parametrize("name", ["moe_route", "moe_permute", "moe_unpermute", "grouped_gemm"])
def test_opcheck(name):
    args = sample_args()[name]
    op = hal.opdef.lookup(name).torch_op
    torch.library.opcheck(op, args)
    if name != "moe_route":  # the differentiable ops, with autograd in play
        with_grad = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                          else a for a in args)
        torch.library.opcheck(op, with_grad)


@pytest.mark.parametrize("name", ["moe_route", "moe_permute", "moe_unpermute", "grouped_gemm"])
def test_compile_fullgraph(name):
    torch._dynamo.reset()
    args = sample_args()[name]
    fn = getattr(hal.ops, name)
    compiled = torch.compile(fn, fullgraph=True)
    got, want = compiled(*args), fn(*args)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_moe_layer():
    torch._dynamo.reset()
    g = gen(18)
    x, logits = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    w13, w2 = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)

    def layer(x, logits):
        weights, ids = hal.ops.moe_route(logits, None, 2, 1, 1, 2.5)
        x_perm, counts, src = hal.ops.moe_permute(x, ids, 4)
        h = hal.ops.grouped_gemm(x_perm, w13, counts)
        y = hal.ops.grouped_gemm(F.silu(h[:, :6]) * h[:, 6:], w2, counts)
        return hal.ops.moe_unpermute(y, src, weights)

    torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x, logits), layer(x, logits))


def test_docs_examples_run():
    text = (REPO / "docs" / "ops" / "moe.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4
    for block in blocks:
        exec(compile(block, "docs/ops/moe.md", "exec"), {})
