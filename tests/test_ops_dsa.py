"""DSA ops (docs/ops/dsa.md): the indexer and sparse / dense MLA attention.

The semantics are pinned from independent angles: naive loops written here against the
contract's formulas, sparse decode against dense decode, paged ops against unpaged ones on
the gathered logical sequence, FP8 keys against the dequantised float keys, top-k against a
brute-force sort of the logits. Then the input contract, torch integration (opcheck,
torch.compile, autograd) and hypothesis properties.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from conftest import REPO, assert_invalid
from glm5_hal.registry import FallbackWarning

# The CPU backend may not implement these ops: the reference answers, which is what we test.
pytestmark = pytest.mark.filterwarnings("ignore", category=FallbackWarning)

FP8 = torch.float8_e4m3fn
I32 = torch.int32
GLM5_SCALE = 256 ** -0.5
NEG_INF = float("-inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def fp8_keys(shape, g):
    """(fp8 values, fp32 positive scales over all but the last dim)."""
    values = (torch.randn(shape, generator=g) * 40).to(FP8)
    scale = torch.rand(shape[:-1], generator=g) * 0.05 + 0.01
    return values, scale


# -- paged layout helpers -------------------------------------------------------------------
def paged_layout(context_lens, block_size, g, *, spare_blocks=2, spare_cols=1):
    """A block table spreading each sequence over shuffled physical blocks; entries past the
    used blocks are -1 padding. Returns (block_table, num_blocks)."""
    used = [math.ceil(c / block_size) for c in context_lens]
    max_blocks = max(used, default=0) + spare_cols
    num_blocks = sum(used) + spare_blocks
    physical = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(context_lens), max_blocks), -1, dtype=I32)
    taken = 0
    for b, u in enumerate(used):
        table[b, :u] = physical[taken:taken + u].to(I32)
        taken += u
    return table, num_blocks


def to_paged(seqs, block_table, filler):
    """`filler` [num_blocks, block_size, ...] (garbage everywhere) with logical row p of
    seqs[b] written at block block_table[b, p // block_size], offset p % block_size."""
    cache = filler.clone()
    block_size = cache.shape[1]
    for b, seq in enumerate(seqs):
        p = torch.arange(seq.shape[0])
        cache[block_table[b, p // block_size].long(), p % block_size] = seq
    return cache


def random_paged(context_lens, block_size, row_shape, g, dtype=torch.float32):
    """Logical sequences of random rows, and a paged cache holding them among garbage rows."""
    table, num_blocks = paged_layout(context_lens, block_size, g)
    seqs = [torch.randn((c, *row_shape), generator=g).to(dtype) for c in context_lens]
    garbage = (torch.randn((num_blocks, block_size, *row_shape), generator=g) * 100).to(dtype)
    return seqs, to_paged(seqs, table, garbage), table


def visible(context_lens, num_queries):
    """[(b, i, number of visible positions)] per the decode rule [0, ctx - N + i + 1)."""
    return [(b, i, max(c - num_queries + i + 1, 0))
            for b, c in enumerate(context_lens) for i in range(num_queries)]


# -- naive formulas, written from the contract independently of the reference --------------
def naive_sparse_attention(q, kv, indices, sm_scale, d_v):
    """Per-(t, h) loop in float64 over the valid entries of indices[t]."""
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, d_v, dtype=torch.float64)
    lse = torch.full((tokens, heads), NEG_INF, dtype=torch.float64)
    for t in range(tokens):
        rows = [int(i) for i in indices[t] if 0 <= int(i) < kv.shape[0]]
        if not rows:
            continue
        for h in range(heads):
            z = [sm_scale * float(q[t, h].double() @ kv[r].double()) for r in rows]
            m = max(z)
            e = [math.exp(v - m) for v in z]
            total = sum(e)
            lse[t, h] = m + math.log(total)
            for w, r in zip(e, rows):
                out[t, h] += (w / total) * kv[r, :d_v].double()
    return out, lse


def naive_indexer_logits(q, k, weights, k_start, k_end):
    tokens, num_keys = q.shape[0], k.shape[0]
    logits = torch.full((tokens, num_keys), NEG_INF, dtype=torch.float64)
    for t in range(tokens):
        for s in range(int(k_start[t]), int(k_end[t])):
            dots = q[t].double() @ k[s].double()                  # [Hi]
            logits[t, s] = float((weights[t].double() * dots.clamp(min=0)).sum())
    return logits


def check_topk_rows(selected, logits, counts, topk):
    """Every row of `selected` is a valid top-k of the same row of `logits` (reference
    scores): distinct in-range entries, left-packed, -1 padded, count = min(topk, keys in
    range), and the selected values are exactly the largest ones (tie-robust)."""
    assert selected.dtype == I32 and selected.shape == (logits.shape[0], topk)
    for row, scores, count in zip(selected.tolist(), logits, counts):
        want = min(topk, count)
        assert all(v >= 0 for v in row[:want]) and all(v == -1 for v in row[want:]), row
        chosen = row[:want]
        assert len(set(chosen)) == want
        assert all(scores[v] != NEG_INF for v in chosen)
        best = torch.sort(scores[scores != NEG_INF], descending=True).values[:want]
        got = torch.sort(scores[chosen], descending=True).values
        assert torch.equal(got, best), (row, scores)


def bf16_tolerance(x):
    return dict(rtol=1.6e-2, atol=1e-2) if x.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


# == sparse_mla_attention =====================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_matches_naive_loop(dtype):
    g = gen(1)
    tokens, heads, dqk, d_v, num_keys = 6, 3, 20, 12, 7
    q = torch.randn(tokens, heads, dqk, generator=g).to(dtype)
    kv = torch.randn(num_keys, dqk, generator=g).to(dtype)
    indices = i32([[0, 1, 2, 3, -1, -1],      # left-packed with padding
                   [4, 4, 4, 1, 6, 0],        # duplicates count once per occurrence
                   [-1, -1, -1, -1, -1, -1],  # nothing valid
                   [7, 2, 100, -5, 5, -1],    # >= S and other negatives are ignored
                   [-1, 3, -1, 6, 7, 6],      # valid entries need not be packed
                   [7, 8, 9, -2, -3, 1000]])  # nothing valid, no -1 either
    out, lse = hal.ops.sparse_mla_attention(q, kv, indices, 0.3, d_v)
    assert out.dtype == dtype and out.shape == (tokens, heads, d_v)
    assert lse.dtype == torch.float32 and lse.shape == (tokens, heads)
    want_out, want_lse = naive_sparse_attention(q, kv, indices, 0.3, d_v)
    torch.testing.assert_close(out.double(), want_out, **bf16_tolerance(q))
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    for empty_row in (2, 5):
        assert torch.equal(out[empty_row], torch.zeros_like(out[empty_row]))
        assert torch.all(lse[empty_row] == NEG_INF)


def test_reference_computes_in_float64_for_float64_inputs():
    # the conformance suite judges backends with the reference on float64-upcast inputs
    g = gen(21)
    q, kv = torch.randn(3, 2, 9, generator=g, dtype=torch.float64), torch.randn(5, 9, generator=g, dtype=torch.float64)
    indices = i32([[0, 4, 4], [-1, 2, 7], [-1, -1, -1]])
    out, lse = hal.reference.sparse_mla_attention(q, kv, indices, 0.3, 6)
    assert out.dtype == lse.dtype == torch.float64
    want_out, want_lse = naive_sparse_attention(q, kv, indices, 0.3, 6)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    qi, k, w = (t.double() for t in indexer_inputs(3, 2, 5, 4, g, distinct=False))
    k_start, k_end = i32([0, 1, 4]), i32([4, 3, 4])
    logits = hal.reference.indexer_logits(qi, k, w, k_start, k_end)
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, naive_indexer_logits(qi, k, w, k_start, k_end), rtol=1e-12, atol=1e-12)


def test_sparse_attention_glm5_dims_lse_is_logsumexp_of_scores():
    g = gen(2)
    tokens, heads, num_keys, topk = 3, 16, 300, 64
    q = torch.randn(tokens, heads, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(num_keys, 576, generator=g).to(torch.bfloat16)
    indices = torch.stack([torch.randperm(num_keys, generator=g)[:topk] for _ in range(tokens)]).to(I32)
    indices[1, 40:] = -1
    out, lse = hal.ops.sparse_mla_attention(q, kv, indices, GLM5_SCALE)   # d_v defaults to 512
    assert out.shape == (tokens, heads, 512)
    # all scores as one dense product, then pick each row's selected columns
    scores = GLM5_SCALE * torch.einsum("thd,sd->ths", q.double(), kv.double())
    for t in range(tokens):
        cols = indices[t][indices[t] >= 0].long()
        z = scores[t][:, cols]
        torch.testing.assert_close(lse[t].double(), torch.logsumexp(z, -1), rtol=1e-5, atol=1e-5)
        want = torch.softmax(z, -1) @ kv[cols, :512].double()
        torch.testing.assert_close(out[t].double(), want, rtol=1.6e-2, atol=1e-2)


def test_sparse_attention_empty_inputs():
    q = torch.randn(0, 2, 8)
    out, lse = hal.ops.sparse_mla_attention(q, torch.randn(5, 8), torch.zeros(0, 3, dtype=I32), 0.5, 4)
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2)
    # no keys at all: every index is out of range, so every row is empty
    out, lse = hal.ops.sparse_mla_attention(torch.randn(2, 2, 8), torch.randn(0, 8), i32([[0, -1], [3, 1]]), 0.5, 4)
    assert torch.equal(out, torch.zeros(2, 2, 4)) and torch.all(lse == NEG_INF)


def test_sparse_attention_non_contiguous_inputs_match_contiguous():
    g = gen(3)
    q = torch.randn(3, 20, 4, generator=g).transpose(1, 2)               # [3, 4, 20], strided
    kv = torch.randn(10, 40, generator=g)[:, ::2]                         # [10, 20], strided rows
    indices = torch.randint(-2, 12, (6, 3), generator=g, dtype=I32).t()  # [3, 6], strided
    out, lse = hal.ops.sparse_mla_attention(q, kv, indices, 0.2, 16)
    want_out, want_lse = hal.ops.sparse_mla_attention(q.contiguous(), kv.contiguous(), indices.contiguous(), 0.2, 16)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


# == dense / sparse paged decode ==============================================================
def sparse_indices_covering(context_lens, num_queries, topk, g, *, invalid=True):
    """[B, N, topk]: per query every visible logical position, shuffled among invalid
    entries (-1, >= context_len, other negatives)."""
    rows = []
    for b, i, n_visible in visible(context_lens, num_queries):
        ctx = context_lens[b]
        fill = [-1, ctx, ctx + 7, -3] if invalid else [-1]
        row = list(range(n_visible)) + [fill[j % len(fill)] for j in range(topk - n_visible)]
        rows.append(torch.tensor(row)[torch.randperm(topk, generator=g)])
    return torch.stack(rows).reshape(len(context_lens), num_queries, topk).to(I32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_decode_equals_dense_decode_when_topk_covers_the_context(dtype):
    g = gen(4)
    context_lens, num_queries, heads, block_size = [5, 17, 1, 0, 9], 2, 8, 4
    seqs, cache, table = random_paged(context_lens, block_size, (576,), g, dtype)
    q = torch.randn(len(context_lens), num_queries, heads, 576, generator=g).to(dtype)
    lens = i32(context_lens)
    indices = sparse_indices_covering(context_lens, num_queries, 20, g)
    dense_out, dense_lse = hal.ops.dense_mla_decode_paged(q, cache, table, lens, GLM5_SCALE, 512)
    sparse_out, sparse_lse = hal.ops.sparse_mla_decode_paged(q, cache, table, lens, indices, GLM5_SCALE, 512)
    assert sparse_out.shape == dense_out.shape == (5, num_queries, heads, 512)
    assert sparse_lse.dtype == dense_lse.dtype == torch.float32
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(sparse_out, dense_out, **tol)
    torch.testing.assert_close(sparse_lse, dense_lse)
    # context 1 with N = 2: the first query sees nothing; context 0: neither does
    for b, i in [(2, 0), (3, 0), (3, 1)]:
        assert torch.all(dense_lse[b, i] == NEG_INF) and torch.equal(dense_out[b, i], torch.zeros_like(dense_out[b, i]))
    assert torch.all(torch.isfinite(dense_lse[2, 1]))


def test_dense_decode_matches_naive_attention_over_the_logical_sequence():
    g = gen(5)
    context_lens, num_queries, heads, dqk, d_v, block_size = [7, 3, 12], 3, 2, 13, 5, 3
    seqs, cache, table = random_paged(context_lens, block_size, (dqk,), g)
    q = torch.randn(3, num_queries, heads, dqk, generator=g)
    out, lse = hal.ops.dense_mla_decode_paged(q, cache, table, i32(context_lens), 0.4, d_v)
    for b, i, n_visible in visible(context_lens, num_queries):
        rows = seqs[b][:n_visible].double()
        z = 0.4 * q[b, i].double() @ rows.T                                 # [H, n]
        torch.testing.assert_close(lse[b, i].double(), torch.logsumexp(z, -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[b, i].double(), torch.softmax(z, -1) @ rows[:, :d_v], rtol=1e-5, atol=1e-5)


def test_sparse_decode_paged_equals_unpaged_on_the_gathered_sequence():
    g = gen(6)
    context_lens, num_queries, heads, dqk, d_v, block_size, topk = [11, 4, 0, 6], 3, 3, 10, 7, 4, 9
    seqs, cache, table = random_paged(context_lens, block_size, (dqk,), g)
    q = torch.randn(4, num_queries, heads, dqk, generator=g)
    # arbitrary logical positions: duplicates, beyond the context, negatives
    indices = torch.randint(-3, 14, (4, num_queries, topk), generator=g, dtype=I32)
    out, lse = hal.ops.sparse_mla_decode_paged(q, cache, table, i32(context_lens), indices, 0.3, d_v)
    for b, seq in enumerate(seqs):
        want_out, want_lse = hal.ops.sparse_mla_attention(q[b], seq, indices[b], 0.3, d_v)
        torch.testing.assert_close(out[b], want_out)
        torch.testing.assert_close(lse[b], want_lse)


def test_decode_ignores_block_table_entries_past_the_used_blocks():
    g = gen(7)
    context_lens, block_size = [5, 8], 4
    seqs, cache, table = random_paged(context_lens, block_size, (6,), g)
    q = torch.randn(2, 1, 2, 6, generator=g)
    lens = i32(context_lens)
    want = hal.ops.dense_mla_decode_paged(q, cache, table, lens, 0.5, 6)
    junk = table.clone()
    junk[0, 2:] = 10 ** 6   # sequence 0 uses blocks 0..1 only
    junk[1, 2:] = -7        # sequence 1 uses blocks 0..1 only
    got = hal.ops.dense_mla_decode_paged(q, cache, junk, lens, 0.5, 6)
    torch.testing.assert_close(got, want)
    indices = i32([[[0, 4, 7, -1]], [[7, 0, 3, 9]]])
    torch.testing.assert_close(hal.ops.sparse_mla_decode_paged(q, cache, junk, lens, indices, 0.5, 6),
                               hal.ops.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.5, 6))


def test_decode_with_an_empty_pool_and_empty_batch():
    q = torch.randn(2, 2, 1, 8)
    cache = torch.empty(0, 4, 8)
    table = torch.empty(2, 0, dtype=I32)
    lens = i32([0, 0])
    out, lse = hal.ops.dense_mla_decode_paged(q, cache, table, lens, 0.5, 8)
    assert torch.equal(out, torch.zeros(2, 2, 1, 8)) and torch.all(lse == NEG_INF)
    out, lse = hal.ops.sparse_mla_decode_paged(q, cache, table, lens, i32([[[0, -1]] * 2] * 2), 0.5, 8)
    assert torch.equal(out, torch.zeros(2, 2, 1, 8)) and torch.all(lse == NEG_INF)
    out, lse = hal.ops.dense_mla_decode_paged(torch.randn(0, 2, 1, 8), torch.randn(3, 4, 8),
                                              torch.empty(0, 2, dtype=I32), torch.empty(0, dtype=I32), 0.5, 8)
    assert out.shape == (0, 2, 1, 8) and lse.shape == (0, 2, 1)


# == indexer ===================================================================================
def indexer_inputs(tokens, heads, dim, num_keys, g, *, distinct=True, dtype=torch.float32):
    """Random indexer inputs. With `distinct`, q and k are positive so no head's relu clips
    and logits are distinct with probability 1 (no ties)."""
    if distinct:
        q = torch.rand(tokens, heads, dim, generator=g) + 0.1
        k = torch.rand(num_keys, dim, generator=g)
    else:
        q = torch.randn(tokens, heads, dim, generator=g)
        k = torch.randn(num_keys, dim, generator=g)
    weights = torch.randn(tokens, heads, generator=g)
    return q.to(dtype), k.to(dtype), weights


def test_indexer_logits_matches_naive_loop():
    g = gen(8)
    q, k, weights = indexer_inputs(5, 3, 7, 9, g, distinct=False)
    k_start, k_end = i32([0, 2, 4, 9, 0]), i32([1, 8, 4, 9, 9])
    logits = hal.ops.indexer_logits(q, k, weights, k_start, k_end)
    assert logits.dtype == torch.float32 and logits.shape == (5, 9)
    want = naive_indexer_logits(q, k, weights, k_start, k_end)
    assert torch.equal(torch.isinf(logits), torch.isinf(want))
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)


def test_indexer_logits_glm5_dims_bf16():
    g = gen(9)
    q, k, weights = indexer_inputs(3, 32, 128, 40, g, distinct=False, dtype=torch.bfloat16)
    weights = weights * 32 ** -0.5 * 128 ** -0.5
    k_start, k_end = i32([0, 0, 10]), i32([1, 40, 25])
    logits = hal.ops.indexer_logits(q, k, weights, k_start, k_end)
    # bf16 inputs are exact in float64: only the float32 accumulation differs
    torch.testing.assert_close(logits.double(), naive_indexer_logits(q, k, weights, k_start, k_end),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("topk", [1, 4, 9, 15])
def test_indexer_topk_is_a_brute_force_top_k_of_the_logits(topk):
    g = gen(10 + topk)
    q, k, weights = indexer_inputs(6, 4, 16, 9, g)
    k_start, k_end = i32([0, 0, 3, 5, 9, 2]), i32([9, 1, 8, 5, 9, 9])
    logits = hal.ops.indexer_logits(q, k, weights, k_start, k_end)
    selected = hal.ops.indexer_topk(q, k, weights, k_start, k_end, topk)
    counts = (k_end - k_start).tolist()
    check_topk_rows(selected, logits, counts, topk)
    for t in range(6):   # distinct logits: the sets themselves are determined
        in_range = list(range(int(k_start[t]), int(k_end[t])))
        want = set(sorted(in_range, key=lambda s: -float(logits[t, s]))[:topk])
        assert set(v for v in selected[t].tolist() if v >= 0) == want


def test_indexer_packed_causal_batch_equals_each_sequence_alone():
    g = gen(11)
    lengths, topk = [5, 7], 3
    q, k, weights = indexer_inputs(12, 4, 8, 12, g)
    offsets = [0, 5]
    # token at position p of the sequence starting at o sees [o, o + p + 1)
    k_start = i32([o for o, n in zip(offsets, lengths) for _ in range(n)])
    k_end = i32([o + p + 1 for o, n in zip(offsets, lengths) for p in range(n)])
    packed = hal.ops.indexer_logits(q, k, weights, k_start, k_end)
    packed_topk = hal.ops.indexer_topk(q, k, weights, k_start, k_end, topk)
    for o, n in zip(offsets, lengths):
        own = slice(o, o + n)
        causal_end = torch.arange(1, n + 1, dtype=I32)
        alone = hal.ops.indexer_logits(q[own], k[own], weights[own], torch.zeros(n, dtype=I32), causal_end)
        assert torch.all(packed[own, :o] == NEG_INF) and torch.all(packed[own, o + n:] == NEG_INF)
        torch.testing.assert_close(packed[own, own], alone)
        alone_topk = hal.ops.indexer_topk(q[own], k[own], weights[own], torch.zeros(n, dtype=I32), causal_end, topk)
        for got, want in zip(packed_topk[own].tolist(), alone_topk.tolist()):
            assert sorted(v for v in got if v >= 0) == sorted(v + o for v in want if v >= 0)
            assert got.count(-1) == want.count(-1) == max(topk - len([v for v in want if v >= 0]), 0)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_keys_equal_the_float_path_on_dequantized_keys(q_dtype):
    g = gen(12)
    q, _, weights = indexer_inputs(4, 3, 16, 10, g, dtype=q_dtype)
    k_fp8, k_scale = fp8_keys((10, 16), g)
    dequant = k_fp8.float() * k_scale[:, None]
    k_start, k_end = i32([0, 1, 0, 10]), i32([10, 7, 3, 10])
    # the contract's definition, pinned on the reference (backends may apply the per-row
    # scale after the dot product: equal within tolerance, judged by conformance)
    with hal.use("reference"):
        got = hal.ops.indexer_logits(q, (k_fp8, k_scale), weights, k_start, k_end)
        # float32 q: same dtype as the dequantised keys; bf16 q is computed in float32 anyway
        want = hal.ops.indexer_logits(q.float(), dequant, weights, k_start, k_end)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(hal.ops.indexer_topk(q, [k_fp8, k_scale], weights, k_start, k_end, 4),
                           hal.ops.indexer_topk(q.float(), dequant, weights, k_start, k_end, 4))


def test_indexer_empty_inputs():
    q, k, w = torch.randn(0, 2, 4), torch.randn(3, 4), torch.randn(0, 2)
    empty = torch.empty(0, dtype=I32)
    assert hal.ops.indexer_logits(q, k, w, empty, empty).shape == (0, 3)
    assert hal.ops.indexer_topk(q, k, w, empty, empty, 2).shape == (0, 2)
    q, w = torch.randn(2, 2, 4), torch.randn(2, 2)
    no_keys = torch.randn(0, 4)
    zeros = i32([0, 0])
    assert hal.ops.indexer_logits(q, no_keys, w, zeros, zeros).shape == (2, 0)
    assert torch.equal(hal.ops.indexer_topk(q, no_keys, w, zeros, zeros, 3), torch.full((2, 3), -1, dtype=I32))


# -- paged indexer -------------------------------------------------------------------------------
def paged_indexer_case(context_lens, num_queries, heads, dim, block_size, g, *, fp8):
    table, num_blocks = paged_layout(context_lens, block_size, g)
    if fp8:
        seqs = [fp8_keys((c, dim), g) for c in context_lens]
        garbage = fp8_keys((num_blocks, block_size, dim), g)
        cache = (to_paged([s[0] for s in seqs], table, garbage[0]),
                 to_paged([s[1] for s in seqs], table, garbage[1] * 1000))
    else:
        seqs = [torch.rand(c, dim, generator=g) for c in context_lens]
        cache = to_paged(seqs, table, torch.randn(num_blocks, block_size, dim, generator=g) * 100)
    q = torch.rand(len(context_lens), num_queries, heads, dim, generator=g) + 0.1
    weights = torch.randn(len(context_lens), num_queries, heads, generator=g)
    return q, seqs, cache, table, weights


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_topk_paged_equals_unpaged_on_the_gathered_sequence(fp8):
    g = gen(13)
    context_lens, num_queries, topk, block_size = [9, 2, 0, 14], 3, 5, 4
    q, seqs, cache, table, weights = paged_indexer_case(context_lens, num_queries, 4, 16, block_size, g, fp8=fp8)
    selected = hal.ops.indexer_topk_paged(q, cache, weights, table, i32(context_lens), topk)
    assert selected.dtype == I32 and selected.shape == (4, num_queries, topk)
    for b, i, n_visible in visible(context_lens, num_queries):
        args = (q[b, i:i + 1], seqs[b], weights[b, i:i + 1], i32([0]), i32([n_visible]))
        logits = hal.ops.indexer_logits(*args)
        check_topk_rows(selected[b, i:i + 1], logits, [n_visible], topk)
        assert set(selected[b, i].tolist()) - {-1} == set(hal.ops.indexer_topk(*args, topk)[0].tolist()) - {-1}


def test_indexer_topk_paged_fp8_equals_float_cache_of_dequantized_keys():
    g = gen(14)
    context_lens, block_size = [6, 11], 5
    q, _, (values, scale), table, weights = paged_indexer_case(context_lens, 2, 3, 8, block_size, g, fp8=True)
    dequant = values.float() * scale[..., None]
    lens = i32(context_lens)
    assert torch.equal(hal.ops.indexer_topk_paged(q, (values, scale), weights, table, lens, 7),
                       hal.ops.indexer_topk_paged(q, dequant, weights, table, lens, 7))


def test_indexer_topk_paged_glm5_dims_topk_beyond_context():
    g = gen(15)
    context_lens, num_queries, topk = [30, 3], 2, 64
    q, seqs, cache, table, weights = paged_indexer_case(context_lens, num_queries, 32, 128, 16, g, fp8=True)
    selected = hal.ops.indexer_topk_paged(q, cache, weights, table, i32(context_lens), topk)
    for b, i, n_visible in visible(context_lens, num_queries):
        row = selected[b, i].tolist()
        assert sorted(row[:n_visible]) == list(range(n_visible)) and row[n_visible:] == [-1] * (topk - n_visible)


# == autograd ==================================================================================
def test_sparse_attention_gradients_flow_and_match_the_reference():
    g = gen(16)
    q = torch.randn(4, 2, 12, generator=g)
    kv = torch.randn(6, 12, generator=g)
    indices = i32([[0, 5, 5, -1], [2, 9, -1, 1], [-1, -1, -1, -1], [3, 4, 0, 1]])
    grad_out, grad_lse = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, generator=g)

    def grads(fn):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, lse = fn(qq, kk, indices, 0.25, 8)
        finite_lse = lse.masked_fill(torch.isinf(lse), 0)
        torch.autograd.backward([out, finite_lse], [grad_out, grad_lse])
        return qq.grad, kk.grad

    got_q, got_kv = grads(hal.ops.sparse_mla_attention)
    want_q, want_kv = grads(hal.reference.sparse_mla_attention)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_kv, want_kv)
    assert torch.equal(got_q[2], torch.zeros_like(got_q[2]))   # an empty row has no inputs
    assert torch.all(torch.isfinite(got_q)) and torch.all(torch.isfinite(got_kv))
    # rows never selected get no gradient
    unselected = sorted(set(range(6)) - {int(i) for i in indices.flatten() if 0 <= int(i) < 6})
    assert all(torch.equal(got_kv[r], torch.zeros(12)) for r in unselected)
    # the reference's VJP (the op's backward) is itself right: gradcheck in float64
    assert torch.autograd.gradcheck(
        lambda a, b: hal.reference.sparse_mla_attention(a, b, indices[[0, 1, 3]], 0.25, 8),
        (q[[0, 1, 3]].double().requires_grad_(), kv.double().requires_grad_()))


def test_indexer_logits_gradients_flow_and_match_the_reference():
    g = gen(17)
    q, k, weights = indexer_inputs(4, 3, 6, 5, g, distinct=False)
    k_start, k_end = i32([0, 1, 0, 2]), i32([5, 3, 1, 5])

    def grads(fn, qq, kk, ww):
        logits = fn(qq, kk, ww, k_start, k_end)
        logits.masked_fill(torch.isinf(logits), 0).pow(2).sum().backward()
        return qq.grad, kk.grad, ww.grad

    got = grads(hal.ops.indexer_logits, *(t.clone().requires_grad_() for t in (q, k, weights)))
    want = grads(hal.reference.indexer_logits, *(t.clone().requires_grad_() for t in (q, k, weights)))
    for a, b in zip(got, want):
        assert a is not None and torch.all(torch.isfinite(a))
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(
        lambda a, b, c: hal.reference.indexer_logits(a, b, c, k_start, k_end).masked_fill(
            (torch.arange(5) < k_start[:, None]) | (torch.arange(5) >= k_end[:, None]), 0),
        tuple(t.double().requires_grad_() for t in (q, k, weights)))


# == invalid inputs ============================================================================
def _indexer_args():
    return [torch.randn(4, 2, 8), torch.randn(6, 8), torch.randn(4, 2), i32([0, 0, 1, 6]), i32([6, 1, 3, 6])]


def _paged_indexer_args():
    table = i32([[2, 0, -1], [1, -1, -1]])
    return [torch.randn(2, 3, 2, 8), torch.randn(3, 4, 8), torch.randn(2, 3, 2), table, i32([7, 2]), 4]


def _sparse_args():
    return [torch.randn(3, 2, 16), torch.randn(5, 16), i32([[0, -1], [4, 9], [1, 1]]), 0.5, 8]


def _decode_args():
    table = i32([[2, 0, -1], [1, -1, -1]])
    return [torch.randn(2, 3, 2, 16), torch.randn(3, 4, 16), table, i32([7, 2]), 0.5, 8]


def _sparse_decode_args():
    args = _decode_args()
    return args[:4] + [torch.zeros(2, 3, 5, dtype=I32)] + args[4:]


def _set(i, value):
    def mutate(args):
        args[i] = value(args) if callable(value) else value
        return args
    return mutate


def _fp8_pair(shape, scale_shape=None, scale_dtype=torch.float32, value_dtype=FP8):
    return lambda args: (torch.randn(shape).to(value_dtype), torch.rand(scale_shape or shape[:-1]).to(scale_dtype))


OPS = {
    "indexer_logits": (hal.ops.indexer_logits, _indexer_args),
    "indexer_topk": (hal.ops.indexer_topk, lambda: _indexer_args() + [3]),
    "indexer_topk_paged": (hal.ops.indexer_topk_paged, _paged_indexer_args),
    "sparse_mla_attention": (hal.ops.sparse_mla_attention, _sparse_args),
    "sparse_mla_decode_paged": (hal.ops.sparse_mla_decode_paged, _sparse_decode_args),
    "dense_mla_decode_paged": (hal.ops.dense_mla_decode_paged, _decode_args),
}

INDEXER_BAD = [
    (_set(0, lambda a: a[0].int()), "q", "dtype float32 or float16 or bfloat16"),
    (_set(0, lambda a: a[0][0]), "q", "a 3-d tensor"),
    (_set(0, torch.randn(4, 0, 8)), "q", "Hi and D >= 1"),
    (_set(1, lambda a: a[1].bfloat16()), "k", "dtype float32 (the dtype of 'q')"),
    (_set(1, torch.randn(6, 7)), "k", "last dim 8"),
    (_set(1, torch.randn(6, 1, 8)), "k", "a 2-d tensor"),
    (_set(1, lambda a: a[1].to(FP8)), "k", "a bare float8_e4m3fn tensor"),
    (_set(1, _fp8_pair((6, 8), value_dtype=torch.float32)), "k", "dtype float8_e4m3fn"),
    (_set(1, _fp8_pair((6, 8), scale_dtype=torch.bfloat16)), "k_scale", "dtype float32"),
    (_set(1, _fp8_pair((6, 8), scale_shape=(5,))), "k_scale", "shape [6]"),
    (_set(1, _fp8_pair((6, 8), scale_shape=(6, 1))), "k_scale", "a 1-d tensor"),
    (_set(1, lambda a: (a[1].to(FP8), torch.rand(6), torch.rand(6))), "k", "a tuple of length 3"),
    (_set(1, lambda a: a[1].to("meta")), "k", "a tensor on cpu"),
    (_set(2, lambda a: a[2].double()), "weights", "dtype float32"),
    (_set(2, torch.randn(4, 3)), "weights", "shape [4, 2]"),
    (_set(2, lambda a: a[2].to("meta")), "weights", "a tensor on cpu"),
    (_set(3, lambda a: a[3].long()), "k_start", "dtype int32"),
    (_set(4, i32([6, 1, 3])), "k_end", "shape [T] = [4]"),
    (_set(4, i32([7, 1, 3, 6])), "k_end", "values in [0, 6]"),
    (_set(4, i32([6, 1, -1, 6])), "k_end", "values in [0, 6]"),
    (_set(3, i32([0, 2, 1, 6])), "k_start", "0 <= k_start[t] <= k_end[t]"),
    (_set(3, i32([-1, 0, 1, 6])), "k_start", "0 <= k_start[t] <= k_end[t]"),
]

PAGED_BAD = [
    (_set(0, torch.randn(2, 3, 8)), "q", "a 4-d tensor"),
    (_set(0, torch.randn(2, 0, 2, 8)), "q", "N and Hi and D >= 1"),
    (_set(1, torch.randn(3, 0, 8)), "k_cache", "block_size >= 1"),
    (_set(1, torch.randn(3, 4, 8).half()), "k_cache", "dtype float32 (the dtype of 'q')"),
    (_set(1, _fp8_pair((3, 4, 8), scale_shape=(3,))), "k_cache_scale", "a 2-d tensor"),
    (_set(1, _fp8_pair((3, 4, 8), scale_shape=(3, 5))), "k_cache_scale", "shape [3, 4]"),
    (_set(2, torch.randn(2, 3, 3)), "weights", "shape [2, 3, 2]"),
    (_set(3, lambda a: a[3].long()), "block_table", "dtype int32"),
    (_set(3, torch.zeros(3, 3, dtype=I32)), "block_table", "shape [B, max_blocks] = [2, *]"),
    (_set(4, i32([7, 2, 0])), "context_lens", "shape [B] = [2]"),
    (_set(4, lambda a: a[4].to("meta")), "context_lens", "a tensor on cpu"),
    (_set(4, i32([13, 2])), "context_lens", "values in [0, 12]"),
    (_set(4, i32([7, -1])), "context_lens", "values in [0, 12]"),
    (_set(3, i32([[2, -1, -1], [1, -1, -1]])), "block_table", "block ids in [0, 3)"),
    (_set(3, i32([[2, 3, -1], [1, -1, -1]])), "block_table", "3 at [0, 1]"),
    (_set(5, 0), "topk", "an int >= 1"),
    (_set(5, 2.0), "topk", "an int"),
]

SPARSE_BAD = [
    (_set(0, lambda a: a[0].double()), "q", "dtype float32 or float16 or bfloat16"),
    (_set(0, torch.randn(3, 0, 16)), "q", "H and Dqk >= 1"),
    (_set(1, lambda a: a[1].half()), "kv", "dtype float32 (the dtype of 'q')"),
    (_set(1, torch.randn(5, 15)), "kv", "shape [*, 16]"),
    (_set(1, lambda a: a[1].to("meta")), "kv", "a tensor on cpu"),
    (_set(2, lambda a: a[2].long()), "indices", "dtype int32"),
    (_set(2, torch.zeros(3, 0, dtype=I32)), "indices", "topk >= 1"),
    (_set(2, torch.zeros(2, 4, dtype=I32)), "indices", "shape [T, topk] = [3, *]"),
    (_set(2, lambda a: a[2].to("meta")), "indices", "a tensor on cpu"),
    (_set(3, 0.0), "sm_scale", "a number > 0.0"),
    (_set(3, -0.1), "sm_scale", "a number > 0.0"),
    (_set(3, float("nan")), "sm_scale", "a finite number"),
    (_set(3, float("inf")), "sm_scale", "a finite number > 0"),
    (_set(3, None), "sm_scale", "a finite number"),
    (_set(4, 17), "d_v", "an int in [1, 16]"),
    (_set(4, 0), "d_v", "an int >= 1"),
    (_set(4, 8.0), "d_v", "an int"),
]

DECODE_BAD = [
    (_set(0, torch.randn(2, 3, 16)), "q", "a 4-d tensor"),
    (_set(1, torch.randn(3, 4, 12)), "kv_cache", "shape [*, *, 16]"),
    (_set(1, lambda a: a[1].bfloat16()), "kv_cache", "dtype float32"),
    (_set(2, torch.zeros(2, 3, dtype=torch.int64)), "block_table", "dtype int32"),
    (_set(3, i32([7, 13])), "context_lens", "values in [0, 12]"),
    (_set(2, i32([[2, 0, -1], [-1, -1, -1]])), "block_table", "-1 at [1, 0]"),
    (_set(2, i32([[2, 9, 0], [1, -1, -1]])), "block_table", "9 at [0, 1]"),
    (_set(4, float("inf")), "sm_scale", "a finite number > 0"),
    (_set(5, 17), "d_v", "an int in [1, 16]"),
]

SPARSE_DECODE_BAD = DECODE_BAD[:5] + [
    (_set(4, torch.zeros(2, 4, 5, dtype=I32)), "indices", "shape [B, N, topk] = [2, 3, *]"),
    (_set(4, torch.zeros(2, 3, 0, dtype=I32)), "indices", "topk >= 1"),
    (_set(4, torch.zeros(2, 3, 5, dtype=torch.int16)), "indices", "dtype int32"),
    (_set(5, 0.0), "sm_scale", "a number > 0.0"),
    (_set(6, 17), "d_v", "an int in [1, 16]"),
]

BAD_CASES = ([("indexer_logits", *c) for c in INDEXER_BAD]
             + [("indexer_topk", *c) for c in INDEXER_BAD]
             + [("indexer_topk", _set(5, 0), "topk", "an int >= 1")]
             + [("indexer_topk_paged", *c) for c in PAGED_BAD]
             + [("sparse_mla_attention", *c) for c in SPARSE_BAD]
             + [("dense_mla_decode_paged", *c) for c in DECODE_BAD]
             + [("sparse_mla_decode_paged", *c) for c in SPARSE_DECODE_BAD])


@pytest.mark.parametrize("op,mutate,arg,expected", BAD_CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(BAD_CASES)])
def test_invalid_input_raises_invalid_input_error(op, mutate, arg, expected):
    fn, make = OPS[op]
    fn(*make())   # the unmutated arguments are valid
    assert_invalid(fn, mutate(make()), op, arg, expected)


def test_fp8_pair_for_the_paged_indexer_is_accepted_and_checked():
    args = _paged_indexer_args()
    args[1] = _fp8_pair((3, 4, 8))(args)
    assert hal.ops.indexer_topk_paged(*args).shape == (2, 3, 4)
    args[3] = i32([[2, 5, -1], [1, -1, -1]])
    with pytest.raises(hal.InvalidInputError, match="block_table"):
        hal.ops.indexer_topk_paged(*args)


# == torch integration =========================================================================
def _flat_cases():
    """(op name, flat torch.ops args) on small inputs, FP8 variants included."""
    g = gen(18)
    q, k, w = indexer_inputs(4, 2, 8, 6, g)
    ks, ke = i32([0, 0, 1, 6]), i32([6, 1, 3, 6])
    k8, sc = fp8_keys((6, 8), g)
    paged = _paged_indexer_args()
    p8, ps = fp8_keys((3, 4, 8), g)
    decode = _decode_args()
    return [
        ("indexer_logits", (q, k, None, w, ks, ke)),
        ("indexer_logits", (q.bfloat16(), k8, sc, w, ks, ke)),
        ("indexer_topk", (q, k, None, w, ks, ke, 3)),
        ("indexer_topk", (q, k8, sc, w, ks, ke, 9)),
        ("indexer_topk_paged", (paged[0], paged[1], None, *paged[2:])),
        ("indexer_topk_paged", (paged[0], p8, ps, *paged[2:])),
        ("sparse_mla_attention", tuple(_sparse_args())),
        ("sparse_mla_attention", (torch.randn(2, 3, 8).bfloat16(), torch.randn(4, 8).bfloat16(),
                                  i32([[0, -1, 3], [-1, -1, -1]]), 0.3, 8)),
        ("sparse_mla_decode_paged", tuple(_sparse_decode_args())),
        ("dense_mla_decode_paged", tuple(_decode_args())),
    ]


def _case_id(op, flat):
    kinds = sorted({str(a.dtype).removeprefix("torch.") for a in flat
                    if isinstance(a, torch.Tensor) and a.is_floating_point()})
    return f"{op}-{'-'.join(kinds)}"


@pytest.mark.parametrize("op,flat", _flat_cases(), ids=[_case_id(*c) for c in _flat_cases()])
def test_opcheck(op, flat):
    torch_op = getattr(torch.ops.glm5_hal, op).default
    if not any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in flat):
        torch.library.opcheck(torch_op, flat)
        return
    # torch's SchemaCheckMode cannot compare float8 tensors on the CPU ("mul_cpu_reduced_float"
    # not implemented), so test_schema is replaced by a byte-level no-mutation check
    before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.dtype == FP8
              else a.clone() if isinstance(a, torch.Tensor) else a for a in flat]
    out = torch_op(*flat)
    for a, b in zip(flat, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b)
            assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    torch.library.opcheck(torch_op, flat, test_utils=(
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("op", ["indexer_logits", "sparse_mla_attention"])
def test_opcheck_with_gradients(op):
    flat = next(f for name, f in _flat_cases() if name == op)
    flat = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.dtype == torch.float32
                 and a.dim() > 1 else a for a in flat)
    torch.library.opcheck(getattr(torch.ops.glm5_hal, op).default, flat)


def _compiled_calls():
    g = gen(19)
    q, k, w = indexer_inputs(4, 2, 8, 6, g)
    ks, ke = i32([0, 0, 1, 6]), i32([6, 1, 3, 6])
    k8, sc = fp8_keys((6, 8), g)
    paged = _paged_indexer_args()
    return [
        ("logits", lambda q, k, w: hal.ops.indexer_logits(q, k, w, ks, ke) * 2, (q, k, w)),
        ("logits_fp8", lambda q, k8, sc, w: hal.ops.indexer_logits(q, (k8, sc), w, ks, ke) + 1, (q, k8, sc, w)),
        ("topk_fp8", lambda q, k8, sc, w: hal.ops.indexer_topk(q, (k8, sc), w, ks, ke, 3) + 0, (q, k8, sc, w)),
        ("topk_paged", lambda *a: hal.ops.indexer_topk_paged(*a, 4) + 0, tuple(paged[:5])),
        ("sparse", lambda q, kv, i: hal.ops.sparse_mla_attention(q, kv, i, 0.5, 8)[0] * 2, tuple(_sparse_args()[:3])),
        ("sparse_scale_input", lambda q, kv, i, scale: hal.ops.sparse_mla_attention(q, kv, i, scale, 8)[1] + 1,
         tuple(_sparse_args()[:3]) + (0.3,)),
        ("sparse_decode", lambda *a: hal.ops.sparse_mla_decode_paged(*a, 0.5, 8)[1] - 1,
         tuple(_sparse_decode_args()[:5])),
        ("dense_decode", lambda *a: hal.ops.dense_mla_decode_paged(*a, 0.5, 8)[0].sum(-1),
         tuple(_decode_args()[:4])),
    ]


@pytest.mark.parametrize("name,fn,args", _compiled_calls(), ids=[c[0] for c in _compiled_calls()])
def test_compile_fullgraph(name, fn, args):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), fn(*args))


def test_compile_fullgraph_inductor_sparse_attention_and_trace_time_checks():
    torch._dynamo.reset()
    q, kv, indices, sm_scale, d_v = _sparse_args()

    def attend(q, kv, indices):
        out, lse = hal.ops.sparse_mla_attention(q, kv, indices, 0.5, 8)
        return out.sum(-1) + lse.masked_fill(torch.isinf(lse), 0)

    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(q, kv, indices), attend(q, kv, indices))
    with pytest.raises(Exception, match="argument 'kv'"):
        compiled(q, kv[:, :15], indices)


def test_compiled_training_step_through_sparse_attention():
    torch._dynamo.reset()
    g = gen(20)
    q = torch.randn(3, 2, 16, generator=g, requires_grad=True)
    kv = torch.randn(5, 16, generator=g, requires_grad=True)
    indices = i32([[0, -1], [4, 9], [1, 1]])

    def loss(q, kv):
        return hal.ops.sparse_mla_attention(q, kv, indices, 0.5, 8)[0].square().sum()

    torch.compile(loss, fullgraph=True, backend="aot_eager")(q, kv).backward()
    got = q.grad.clone(), kv.grad.clone()
    q.grad = kv.grad = None
    loss(q, kv).backward()
    torch.testing.assert_close(got[0], q.grad)
    torch.testing.assert_close(got[1], kv.grad)


def test_decisions_are_keyed_on_whether_keys_are_fp8():
    q, k, w, ks, ke = _indexer_args()
    plain = hal.explain("indexer_logits", q, k, w, ks, ke)
    fp8 = hal.explain("indexer_logits", q, (k.to(FP8), torch.rand(6)), w, ks, ke)
    assert plain.key[-1] is False and fp8.key[-1] is True
    bad = hal.explain("indexer_logits", q, k, w, ks, i32([7, 1, 3, 6]))
    assert bad.error and "k_end" in bad.error


# == properties ================================================================================
@settings(max_examples=40, deadline=None)
@given(context_lens=st.lists(st.integers(0, 12), min_size=1, max_size=3),
       num_queries=st.integers(1, 3), block_size=st.integers(1, 5), heads=st.integers(1, 3),
       dqk=st.integers(1, 9), d_v_frac=st.floats(0, 1), extra=st.integers(0, 3),
       seed=st.integers(0, 2 ** 31 - 1))
def test_property_sparse_decode_equals_dense_decode(context_lens, num_queries, block_size, heads,
                                                   dqk, d_v_frac, extra, seed):
    g = gen(seed)
    d_v = max(1, round(d_v_frac * dqk))
    _, cache, table = random_paged(context_lens, block_size, (dqk,), g)
    q = torch.randn(len(context_lens), num_queries, heads, dqk, generator=g)
    lens = i32(context_lens)
    topk = max(context_lens) + extra + 1
    indices = sparse_indices_covering(context_lens, num_queries, topk, g)
    dense = hal.ops.dense_mla_decode_paged(q, cache, table, lens, 0.7, d_v)
    sparse = hal.ops.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.7, d_v)
    torch.testing.assert_close(sparse, dense)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 6), num_keys=st.integers(0, 12), heads=st.integers(1, 3),
       dim=st.integers(1, 8), topk=st.integers(1, 15), seed=st.integers(0, 2 ** 31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_property_indexer_topk_is_a_top_k_of_the_logits(tokens, num_keys, heads, dim, topk, seed, dtype):
    g = gen(seed)
    q, k, weights = indexer_inputs(tokens, heads, dim, num_keys, g, distinct=False, dtype=dtype)
    k_end = torch.randint(0, num_keys + 1, (tokens,), generator=g)
    k_start = (torch.rand(tokens, generator=g) * (k_end + 1)).long().clamp(max=k_end)
    k_start, k_end = k_start.to(I32), k_end.to(I32)
    logits = hal.ops.indexer_logits(q, k, weights, k_start, k_end)
    torch.testing.assert_close(logits.double(), naive_indexer_logits(q, k, weights, k_start, k_end),
                               rtol=1e-5, atol=1e-5)
    selected = hal.ops.indexer_topk(q, k, weights, k_start, k_end, topk)
    check_topk_rows(selected, logits, (k_end - k_start).tolist(), topk)


# == documentation =============================================================================
def _doc_examples():
    text = (REPO / "docs" / "ops" / "dsa.md").read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


@pytest.mark.parametrize("source", _doc_examples(), ids=lambda s: s.split("hal.ops.", 1)[1].split("(", 1)[0])
def test_doc_example_runs(source):
    exec(compile(source, "docs/ops/dsa.md", "exec"), {})
