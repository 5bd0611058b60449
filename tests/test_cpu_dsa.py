"""DSA ops on the native cpu backend (csrc/dsa*.cpp) against glm5_hal.reference.

Every kernel runs on every instruction tier this CPU has (portable C++, AVX-512,
AVX-512 + BF16), over the three activation dtypes, odd sizes that hit tile remainders,
GLM-5 dims, and the contract's edge cases. The reference runs in float64 on the very same
(rounded) inputs.

Tolerances. The CONFORMANCE.md base table applies elementwise, but fp32 reductions with
cancellation (signed weighted sums) can land near 0, where |ref| is no scale for the error.
So the base fp32 rtol (1.3e-6, ~22 ulp) is applied to the magnitude of what is summed
instead of being widened by a guessed factor:
- indexer logits: |err| <= 1e-5 + 1.3e-6 * sum_h |w_h| |q_h| . |k|.
- attention lse: |err| <= 1e-5 + 1.3e-6 * (|lse| + zmag), zmag = sm_scale * max_j |q| . |k_j|
  (an fp32 dot product over Dqk terms is off by a few ulp of that).
- attention out: |err| <= 1e-5 + rtol(dtype) * |ref| + 1.3e-6 * (1 + zmag) * sum_j p_j |v_j|:
  one rounding of the output, plus the fp32 error of the weighted sum, whose weights move
  by a factor exp(dz) with dz ~ eps * zmag.
Measured on this machine's three tiers with |z| up to ~600 and |v| up to ~100, Dqk 576,
topk 2048, D 128, Hi 32: at most a quarter of these bounds (no widening was needed).
- top-k rows: the conformance rule (distinct, in range, left-packed, -1 padded, count
  min(topk, keys in range), each selected key's reference logit >= the reference k-th
  largest minus tau), tau being the logits tolerance.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import glm5_hal as hal
from glm5_hal import _C
from glm5_hal.backends.cpu import dsa as cpu_dsa
from glm5_hal.reference import dsa as ref

from cpu_helpers import native_view

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn
DTYPES = [F32, F16, BF16]
BASE_TOL = {F32: (1.3e-6, 1e-5), F16: (1e-3, 1e-5), BF16: (1.6e-2, 1e-5)}
FP32_RTOL, ATOL = BASE_TOL[F32]
TIERS = list(range(_C.dsa_max_isa() + 1))


@pytest.fixture(params=TIERS, ids=lambda t: f"tier{t}")
def tier(request):
    """Caps the native DSA kernels at one instruction tier for the test."""
    previous = _C.dsa_set_isa_limit(request.param)
    assert _C.dsa_isa() == request.param
    yield request.param
    _C.dsa_set_isa_limit(previous)


@pytest.fixture
def threads():
    """Sets torch's (and so the kernels') thread count for the test."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def gen(*key) -> torch.Generator:
    """A generator seeded by the test's parameters (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g, *shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def fp8_rows(x: torch.Tensor):
    """(e4m3 values, per-row float32 scale) as the indexer cache stores keys."""
    scale = x.abs().amax(-1).clamp(min=1e-4) / 448
    return (x / scale.unsqueeze(-1)).to(FP8), scale.float()


def dequant(k) -> torch.Tensor:
    if isinstance(k, tuple):
        return k[0].double() * k[1].double().unsqueeze(-1)
    return k.double()


def upcast(k):
    """The reference's inputs: float tensors in float64, FP8 pairs as they are."""
    return k if isinstance(k, tuple) else k.double()


# -- comparisons ------------------------------------------------------------------------------
def attention_scales(q, rows, valid, sm_scale, d_v):
    """(sum_j p_j |v_j| [..., H, d_v], zmag = sm_scale * max_j |q| . |k_j| [..., H]) for q
    [..., H, Dqk] over rows [..., K, Dqk] where valid [..., K]: the magnitudes the errors of
    out and lse scale with (see the module docstring)."""
    q, rows = q.double(), rows.double()
    z = (q @ rows.transpose(-1, -2) * sm_scale).masked_fill(~valid.unsqueeze(-2), float("-inf"))
    p = torch.softmax(z, -1).nan_to_num(0.0)
    mag = p @ rows[..., :d_v].abs()
    zabs = (q.abs() @ rows.abs().transpose(-1, -2) * sm_scale).masked_fill(~valid.unsqueeze(-2), 0.0)
    return mag, zabs.amax(-1) if zabs.shape[-1] else zabs.sum(-1)


def assert_attention_close(out, lse, ref_out, ref_lse, dtype, scales):
    mag, zmag = scales
    assert out.dtype == dtype and lse.dtype == F32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    err = (out.double() - ref_out).abs()
    bound = ATOL + BASE_TOL[dtype][0] * ref_out.abs() + FP32_RTOL * (1 + zmag.unsqueeze(-1)) * mag
    assert bool((err <= bound).all()), f"out: max err/bound {(err / bound).max().item():.3g}"
    # lse is float32 for every dtype; rows without a valid index must be exactly -inf
    none = ref_lse == float("-inf")
    assert torch.equal(lse[none], ref_lse[none].float()) and bool(torch.isfinite(lse[~none]).all())
    err = (lse.double() - ref_lse)[~none].abs()
    bound = ATOL + FP32_RTOL * (ref_lse[~none].abs() + zmag[~none])
    assert bool((err <= bound).all()), f"lse: max err/bound {(err / bound).max().item():.3g}"


def sparse_rows(kv, indices):
    """The rows sparse attention reads for each index, and which indices are valid."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    table = kv if kv.shape[0] else kv.new_zeros(1, kv.shape[1])
    return table[torch.where(valid, indices.long(), 0)], valid


def logical_rows(cache, table, positions, valid):
    """Paged rows of logical positions [B, ...] (valid ones; others read a dummy row)."""
    block_size, dim = cache.shape[1], cache.shape[2]
    safe = torch.where(valid, positions.long(), 0)
    blocks = table.long().clamp(min=0)
    if blocks.shape[1] == 0:
        blocks = blocks.new_zeros(blocks.shape[0], 1)
    blk = blocks.gather(1, (safe // block_size).flatten(1)).view(safe.shape)
    slots = torch.where(valid, blk * block_size + safe % block_size, 0)
    return cache.reshape(-1, dim)[slots], valid


def paged_sparse_rows(cache, table, context_lens, indices):
    valid = (indices >= 0) & (indices < context_lens.view(-1, 1, 1))
    return logical_rows(cache, table, indices, valid)


def dense_rows(cache, table, context_lens, queries):
    length = int(context_lens.max()) if context_lens.numel() else 0
    batch = context_lens.shape[0]
    pos = torch.arange(length).expand(batch, queries, length)
    visible = (context_lens.view(-1, 1) - queries + torch.arange(queries) + 1).clamp(min=0)
    return logical_rows(cache, table, pos, pos < visible.unsqueeze(-1))


def logits_scale(q, k, weights, k_start, k_end):
    """sum_h |w| |q_h| . |k|: the magnitude of the terms each logit sums (for the tolerance)."""
    return ref.indexer_logits(q.double().abs(), dequant(k).abs(), weights.double().abs(), k_start, k_end)


def assert_logits_close(out, ref_logits, scale):
    assert out.dtype == F32 and out.shape == ref_logits.shape
    inside = torch.isfinite(ref_logits)
    assert torch.equal(out[~inside], ref_logits[~inside].float()), "-inf outside [k_start, k_end)"
    err = (out.double() - ref_logits)[inside].abs()
    bound = ATOL + FP32_RTOL * scale[inside]
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"


def assert_topk_valid(idx, ref_logits, scale, lo, hi, topk):
    """Conformance rule for top-k rows (CONFORMANCE.md 2). idx [R, topk]; ref_logits and
    scale [R, S] float64; the row's keys in range are [lo[r], hi[r])."""
    assert idx.dtype == torch.int32 and idx.shape == (ref_logits.shape[0], topk)
    for r in range(idx.shape[0]):
        a, b = int(lo[r]), int(hi[r])
        count = min(topk, max(0, b - a))
        row = idx[r]
        assert torch.all(row[count:] == -1), f"row {r}: padding {row[count:].tolist()}"
        chosen = row[:count].long()
        assert torch.all((chosen >= a) & (chosen < b)), f"row {r}: out of range"
        assert chosen.unique().numel() == count, f"row {r}: duplicates"
        if count:
            kth = torch.topk(ref_logits[r, a:b], count).values[-1]
            tau = ATOL + FP32_RTOL * scale[r, a:b].max()
            assert bool((ref_logits[r, chosen] >= kth - tau).all()), f"row {r}: a key below the k-th largest"


# -- inputs -----------------------------------------------------------------------------------
def make_paging(g, context_lens, block_size, *, queries_pad=1, spare_blocks=3):
    """A shuffled block table; entries past each sequence's used blocks are -1 padding."""
    batch = len(context_lens)
    max_blocks = max([math.ceil(c / block_size) for c in context_lens] + [0]) + queries_pad
    num_blocks = batch * max_blocks + spare_blocks
    table = torch.randperm(num_blocks, generator=g)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    for b, c in enumerate(context_lens):
        table[b, math.ceil(c / block_size):] = -1
    return table, torch.tensor(context_lens, dtype=torch.int32).view(batch), num_blocks


def indexer_inputs(g, dtype, tokens, heads, dim, keys, *, fp8=False, ranges="random"):
    q = randn(g, tokens, heads, dim, dtype=dtype)
    kf = torch.randn(keys, dim, generator=g)
    k = fp8_rows(kf) if fp8 else kf.to(dtype)
    weights = torch.randn(tokens, heads, generator=g)
    if ranges == "causal":  # a packed prefill batch of two sequences
        first = tokens // 2
        pos = torch.cat([torch.arange(first), torch.arange(tokens - first)])
        offset = torch.cat([torch.zeros(first), torch.full((tokens - first,), keys - (tokens - first))]).long()
        start, end = offset, (offset + pos + 1).clamp(max=keys)
        start = torch.minimum(start, end)
    else:
        start = torch.randint(0, keys + 1, (tokens,), generator=g)
        end = torch.minimum(start + torch.randint(0, keys + 1, (tokens,), generator=g), torch.tensor(keys))
    return q, k, weights, start.to(torch.int32), end.to(torch.int32)


# -- indexer ----------------------------------------------------------------------------------
INDEXER_SHAPES = [  # tokens, heads, dim, keys, topk
    (1, 1, 1, 1, 1),
    (3, 17, 33, 50, 7),
    (5, 3, 17, 129, 200),      # topk > keys
    (17, 32, 128, 300, 64),    # GLM-5 indexer dims
    (4, 64, 128, 1000, 129),   # DeepSeek-V3.2 heads
    (0, 4, 16, 10, 3),         # empty batch
    (2, 5, 8, 0, 4),           # no keys at all
]


@pytest.mark.parametrize("fp8", [False, True], ids=["float_keys", "fp8_keys"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", INDEXER_SHAPES, ids=str)
def test_indexer_logits_and_topk(tier, dtype, fp8, shape):
    tokens, heads, dim, keys, topk = shape
    g = gen("indexer", shape, str(dtype), fp8)
    args = indexer_inputs(g, dtype, tokens, heads, dim, keys, fp8=fp8)
    q, k, w, ks, ke = args
    expected = ref.indexer_logits(q.double(), upcast(k), w.double(), ks, ke)
    scale = logits_scale(*args)
    assert_logits_close(cpu_dsa.indexer_logits(*args), expected, scale)
    assert_topk_valid(cpu_dsa.indexer_topk(*args, topk), expected, scale, ks, ke, topk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_keys_match_float_keys_dequantised(tier, dtype):
    """FP8 keys mean k_fp8.float() * k_scale: float32 and float16 queries dequantise exactly
    that way (bit-identical to passing the dequantised keys); the bfloat16 dot-product path
    applies the scale after each dot, equal within the logits tolerance."""
    g = gen("fp8=float", str(dtype))
    q, (k8, ks8), w, ks, ke = indexer_inputs(g, dtype, 9, 17, 40, 130, fp8=True)
    dequantised = k8.float() * ks8.unsqueeze(-1)
    got = cpu_dsa.indexer_logits(q, (k8, ks8), w, ks, ke)
    if dtype == F32:
        want = cpu_dsa.indexer_logits(q, dequantised, w, ks, ke)
        assert torch.equal(got, want)
        assert torch.equal(cpu_dsa.indexer_topk(q, (k8, ks8), w, ks, ke, 5),
                           cpu_dsa.indexer_topk(q, dequantised, w, ks, ke, 5))
    expected = ref.indexer_logits(q.double(), dequantised.double(), w.double(), ks, ke)
    assert_logits_close(got, expected, logits_scale(q, dequantised, w, ks, ke))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_prefill_ranges(tier, dtype):
    """Packed causal prefill: consecutive tokens share key loads in the kernel."""
    g = gen("prefill", str(dtype))
    args = indexer_inputs(g, dtype, 70, 32, 128, 200, ranges="causal")
    q, k, w, ks, ke = args
    expected = ref.indexer_logits(q.double(), k.double(), w.double(), ks, ke)
    scale = logits_scale(*args)
    assert_logits_close(cpu_dsa.indexer_logits(*args), expected, scale)
    assert_topk_valid(cpu_dsa.indexer_topk(*args, 16), expected, scale, ks, ke, 16)


def test_indexer_topk_long_rows_split_over_threads(tier, threads):
    """One query over many keys: the key range is split over threads and the parts' candidates
    merged; chunked streaming selection keeps the best topk across chunks."""
    threads(4)
    g = gen("long-rows")
    args = indexer_inputs(g, BF16, 2, 32, 128, 40000)
    q, k, w, ks, ke = args
    ks[:] = 0
    ke[:] = torch.tensor([40000, 33333], dtype=torch.int32)
    expected = ref.indexer_logits(q.double(), k.double(), w.double(), ks, ke)
    scale = logits_scale(*args)
    for topk in (1, 2048, 39999):
        assert_topk_valid(cpu_dsa.indexer_topk(*args, topk), expected, scale, ks, ke, topk)


def test_indexer_ties_pick_exactly_topk(tier):
    """All logits equal (zero queries): exactly min(topk, keys in range) distinct positions."""
    q = torch.zeros(3, 4, 8)
    k = torch.randn(100, 8, generator=gen("ties"))
    w = torch.ones(3, 4)
    ks = torch.tensor([0, 10, 50], dtype=torch.int32)
    ke = torch.tensor([100, 15, 50], dtype=torch.int32)
    out = cpu_dsa.indexer_topk(q, k, w, ks, ke, 7)
    expected = ref.indexer_logits(q.double(), k.double(), w.double(), ks, ke)
    assert_topk_valid(out, expected, torch.zeros_like(expected), ks, ke, 7)
    assert (out[2] == -1).all()


PAGED_INDEXER = [  # batch, queries, heads, dim, block_size, context_lens, topk
    (2, 1, 32, 128, 16, [37, 100], 20),
    (3, 3, 5, 19, 7, [0, 2, 50], 8),           # empty sequence, context < N
    (1, 4, 17, 33, 1, [9], 3),                 # block_size 1, MTP N=4
    (2, 2, 64, 128, 64, [3000, 130], 512),     # DeepSeek heads, several chunks
    (0, 1, 4, 16, 8, [], 5),                   # empty batch
]


@pytest.mark.parametrize("fp8", [False, True], ids=["float_keys", "fp8_keys"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAGED_INDEXER, ids=str)
def test_indexer_topk_paged(tier, dtype, fp8, case):
    batch, queries, heads, dim, block_size, lens, topk = case
    g = gen("paged-indexer", str(case), str(dtype), fp8)
    table, context_lens, num_blocks = make_paging(g, lens, block_size)
    cachef = torch.randn(num_blocks, block_size, dim, generator=g)
    cache = fp8_rows(cachef) if fp8 else cachef.to(dtype)
    q = randn(g, batch, queries, heads, dim, dtype=dtype)
    w = torch.randn(batch, queries, heads, generator=g)
    out = cpu_dsa.indexer_topk_paged(q, cache, w, table, context_lens, topk)
    assert out.shape == (batch, queries, topk)
    # the reference logits of each query over its sequence's logical keys
    keys_all = dequant(cache).reshape(-1, dim)
    for b, length in enumerate(lens):
        pos = torch.arange(length)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size if length else pos
        keys = keys_all[slots]
        vis = [max(0, length - queries + i + 1) for i in range(queries)]
        zeros = torch.zeros(queries, dtype=torch.int32)
        ends = torch.tensor(vis, dtype=torch.int32)
        expected = ref.indexer_logits(q[b].double(), keys, w[b].double(), zeros, ends)
        scale = ref.indexer_logits(q[b].double().abs(), keys.abs(), w[b].double().abs(), zeros, ends)
        assert_topk_valid(out[b], expected, scale, zeros, ends, topk)
    # and the count matches the reference op exactly
    expected_count = (ref.indexer_topk_paged(q.double(), upcast(cache), w.double(), table, context_lens, topk) >= 0)
    assert torch.equal((out >= 0).sum(-1), expected_count.sum(-1))


# -- attention --------------------------------------------------------------------------------
SPARSE_SHAPES = [  # tokens, heads, dqk, keys, topk, d_v, sm_scale
    (1, 1, 1, 1, 1, 1, 0.5),
    (3, 17, 33, 50, 7, 31, 0.3),
    (5, 3, 17, 129, 200, 5, 0.2),
    (2, 64, 576, 300, 100, 512, 256 ** -0.5),   # GLM-5 dims
    (1, 129, 80, 40, 600, 64, 0.1),             # 129 heads: 3 head groups with a remainder
    (0, 4, 16, 10, 3, 8, 0.1),                  # empty batch
    (2, 4, 16, 0, 3, 8, 0.1),                   # no rows: every index invalid
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SPARSE_SHAPES, ids=str)
def test_sparse_mla_attention(tier, dtype, shape):
    tokens, heads, dqk, keys, topk, d_v, sm_scale = shape
    g = gen("sparse", shape, str(dtype))
    q = randn(g, tokens, heads, dqk, dtype=dtype)
    kv = randn(g, keys, dqk, dtype=dtype)
    # -1, out-of-range and duplicate entries; the first row has no valid entry at all
    indices = torch.randint(-2, keys + 3, (tokens, topk), generator=g, dtype=torch.int32)
    if tokens:
        indices[0] = torch.where(torch.arange(topk) % 2 == 0, -1, keys)
        if tokens > 1 and keys:
            indices[1, : topk // 2] = keys // 2
    out, lse = cpu_dsa.sparse_mla_attention(q, kv, indices, sm_scale, d_v)
    ref_out, ref_lse = ref.sparse_mla_attention(q.double(), kv.double(), indices, sm_scale, d_v)
    assert_attention_close(out, lse, ref_out, ref_lse, dtype,
                           attention_scales(q, *sparse_rows(kv, indices), sm_scale, d_v))
    if tokens:
        assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


PAGED_ATTENTION = [  # batch, queries, heads, dqk, d_v, block_size, context_lens, topk
    (2, 1, 16, 64, 32, 16, [37, 100], 20),
    (3, 3, 5, 19, 7, 7, [0, 2, 50], 8),
    (1, 2, 64, 576, 512, 64, [700], 512),       # GLM-5 dims, MTP N=2, split over threads
    (4, 1, 3, 33, 33, 1, [3, 1, 0, 9], 4),
    (0, 2, 4, 16, 16, 4, [], 4),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAGED_ATTENTION, ids=str)
def test_paged_decode(tier, dtype, case):
    batch, queries, heads, dqk, d_v, block_size, lens, topk = case
    g = gen("paged-attention", str(case), str(dtype))
    table, context_lens, num_blocks = make_paging(g, lens, block_size)
    cache = randn(g, num_blocks, block_size, dqk, dtype=dtype)
    q = randn(g, batch, queries, heads, dqk, dtype=dtype)
    indices = torch.randint(-3, max(lens + [0]) + 3, (batch, queries, topk), generator=g, dtype=torch.int32)
    args = (q, cache, table, context_lens)
    out, lse = cpu_dsa.sparse_mla_decode_paged(*args, indices, 0.07, d_v)
    ref_out, ref_lse = ref.sparse_mla_decode_paged(q.double(), cache.double(), table, context_lens, indices, 0.07, d_v)
    rows = paged_sparse_rows(cache, table, context_lens, indices)
    assert_attention_close(out, lse, ref_out, ref_lse, dtype, attention_scales(q, *rows, 0.07, d_v))
    out, lse = cpu_dsa.dense_mla_decode_paged(*args, 0.07, d_v)
    ref_out, ref_lse = ref.dense_mla_decode_paged(q.double(), cache.double(), table, context_lens, 0.07, d_v)
    rows = dense_rows(cache, table, context_lens, queries)
    assert_attention_close(out, lse, ref_out, ref_lse, dtype, attention_scales(q, *rows, 0.07, d_v))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_decode_with_every_visible_key_equals_dense(tier, dtype):
    """docs/ops/dsa.md: with topk >= context_len the sparse op equals the dense one."""
    g = gen("sparse=dense", str(dtype))
    lens, queries = [300, 5, 64], 2
    table, context_lens, num_blocks = make_paging(g, lens, 16)
    cache = randn(g, num_blocks, 16, 72, dtype=dtype)
    q = randn(g, 3, queries, 8, 72, dtype=dtype)
    indices = torch.full((3, queries, 320), -1, dtype=torch.int32)
    for b, length in enumerate(lens):
        for i in range(queries):
            visible = max(0, length - queries + i + 1)
            indices[b, i, :visible] = torch.randperm(visible, generator=g).to(torch.int32)
    sparse = cpu_dsa.sparse_mla_decode_paged(q, cache, table, context_lens, indices, 0.1, 64)
    dense = cpu_dsa.dense_mla_decode_paged(q, cache, table, context_lens, 0.1, 64)
    # the same terms summed in another order: fp32 rounding only, on |z| < 1 and |v| ~ 1
    torch.testing.assert_close(sparse[0].double(), dense[0].double(), rtol=BASE_TOL[dtype][0], atol=ATOL)
    torch.testing.assert_close(sparse[1], dense[1], rtol=FP32_RTOL, atol=ATOL)


def test_decode_split_over_threads_with_empty_splits(tier, threads):
    """One sequence, many indices: the index list is split over threads and merged by (max, sum);
    a split holding only invalid indices must not disturb the merge."""
    threads(4)
    g = gen("splits")
    table, context_lens, num_blocks = make_paging(g, [3000], 64)
    cache = randn(g, num_blocks, 64, 96, dtype=BF16)
    q = randn(g, 1, 1, 16, 96, dtype=BF16)
    indices = torch.randint(0, 3000, (1, 1, 2048), generator=g, dtype=torch.int32)
    indices[..., 512:1536] = -1
    out, lse = cpu_dsa.sparse_mla_decode_paged(q, cache, table, context_lens, indices, 0.1, 64)
    ref_out, ref_lse = ref.sparse_mla_decode_paged(q.double(), cache.double(), table, context_lens, indices, 0.1, 64)
    rows = paged_sparse_rows(cache, table, context_lens, indices)
    assert_attention_close(out, lse, ref_out, ref_lse, BF16, attention_scales(q, *rows, 0.1, 64))


def test_strided_caches_are_read_in_place():
    """Caches and key rows with padded strides (e.g. slices of a wider buffer) give the same
    result as their contiguous copies."""
    g = gen("strided")
    wide = randn(g, 40, 8, 100, dtype=BF16)
    cache = wide[:, :, :72]                       # row stride 100
    table, context_lens, _ = make_paging(g, [90, 30], 8)
    q = randn(g, 2, 1, 4, 72, dtype=BF16)
    idx = torch.randint(0, 30, (2, 1, 16), generator=g, dtype=torch.int32)
    got = cpu_dsa.sparse_mla_decode_paged(q, cache, table, context_lens, idx, 0.1, 64)
    want = cpu_dsa.sparse_mla_decode_paged(q, cache.contiguous(), table, context_lens, idx, 0.1, 64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    keys = randn(g, 50, 3, 16, dtype=F32)[:, 1]   # row stride 48
    qi, w = randn(g, 4, 2, 16), torch.randn(4, 2, generator=g)
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 50, dtype=torch.int32)
    assert torch.equal(cpu_dsa.indexer_logits(qi, keys, w, ks, ke),
                       cpu_dsa.indexer_logits(qi, keys.contiguous(), w, ks, ke))
    kt = randn(g, 16, 50, dtype=F32).t()          # column-major: copied, same answer
    assert torch.equal(cpu_dsa.indexer_logits(qi, kt, w, ks, ke), cpu_dsa.indexer_logits(qi, kt.contiguous(), w, ks, ke))


# -- dispatch ---------------------------------------------------------------------------------
def test_public_ops_dispatch_to_cpu():
    g = gen("dispatch")
    q, k, w, ks, ke = indexer_inputs(g, BF16, 3, 4, 16, 20)
    table, lens, nb = make_paging(g, [20, 7], 4)
    cache = randn(g, nb, 4, 16, dtype=BF16)
    qp, wp = randn(g, 2, 1, 4, 16, dtype=BF16), torch.randn(2, 1, 4, generator=g)
    qa, kv = randn(g, 3, 4, 24, dtype=BF16), randn(g, 20, 24, dtype=BF16)
    idx = torch.randint(-1, 20, (3, 5), generator=g, dtype=torch.int32)
    qd, cd = randn(g, 2, 1, 4, 24, dtype=BF16), randn(g, nb, 4, 24, dtype=BF16)
    idx_paged = torch.randint(-1, 20, (2, 1, 5), generator=g, dtype=torch.int32)
    calls = {
        "indexer_logits": (q, k, w, ks, ke),
        "indexer_topk": (q, k, w, ks, ke, 4),
        "indexer_topk_paged": (qp, cache, wp, table, lens, 4),
        "sparse_mla_attention": (qa, kv, idx, 0.2, 16),
        "sparse_mla_decode_paged": (qd, cd, table, lens, idx_paged, 0.2, 16),
        "dense_mla_decode_paged": (qd, cd, table, lens, 0.2, 16),
    }
    for op, args in calls.items():
        with hal.use("cpu"):
            assert hal.explain(op, *args).chosen == f"cpu.{op}"
            got = getattr(hal.ops, op)(*args)
        want = getattr(cpu_dsa, op)(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b)
    with hal.use("cpu"):  # FP8 keys take the same implementation
        assert hal.explain("indexer_topk", q, fp8_rows(k.float()), w, ks, ke, 4).chosen == "cpu.indexer_topk"


# -- the native checks themselves -------------------------------------------------------------
def _paged_call(q, cache, table, lens, over=()):
    """_C.sparse_mla_decode_paged with consistent arguments, any of which `over` (a dict) replaces."""
    a = dict(out=torch.empty(q.shape), lse=torch.empty(q.shape[:3]), q=q, kv_cache=cache, block_table=table,
             context_lens=lens, indices=torch.zeros(q.shape[0], q.shape[1], 2, dtype=torch.int32), sm_scale=0.5,
             num_threads=1)
    a.update(over)
    _C.sparse_mla_decode_paged(**a)


def test_native_checks_reject_bad_indices_before_writing():
    q = torch.ones(2, 1, 3, 8)
    cache = torch.ones(3, 4, 8)
    table = torch.tensor([[0, -1], [2, 1]], dtype=torch.int32)
    lens = torch.tensor([4, 8], dtype=torch.int32)
    _paged_call(q, cache, table, lens)  # consistent: fine
    out = torch.empty(2, 1, 3, 8)
    v = native_view
    cases = [
        (dict(context_lens=torch.tensor([4, 9], dtype=torch.int32)), "context_lens", "values in [0, 8]"),
        (dict(context_lens=torch.tensor([-1, 0], dtype=torch.int32)), "context_lens", "values in [0, 8]"),
        (dict(block_table=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)), "block_table", "block ids in [0, 3)"),
        (dict(block_table=torch.tensor([[-1, 0], [2, 1]], dtype=torch.int32)), "block_table", "block ids in [0, 3)"),
        (dict(kv_cache=v(cache, size=(2, 4, 8))), "block_table", "block ids in [0, 2)"),
        (dict(kv_cache=v(cache, stride=(32, 7, 1))), "kv_cache", "strides of non-overlapping rows"),
        (dict(out=v(out, size=(2, 1, 3, 9), stride=(27, 27, 9, 1))), "d_v", "[1, 8]"),
        (dict(sm_scale=float("nan")), "sm_scale", "finite"),
        (dict(q=v(q, dtype=7)), "q", "dtype float32, float16 or bfloat16"),
        (dict(kv_cache=v(cache, dtype=2)), "kv_cache", "dtype float32"),
        (dict(indices=torch.zeros(2, 1, 0, dtype=torch.int32)), "indices", "topk >= 1"),
        (dict(kv_cache=v(cache, size=(3, 0, 8))), "kv_cache", "block_size >= 1"),
        (dict(block_table=v(table, size=(2, 3))), "block_table", "a row stride >= max_blocks"),
    ]
    for over, arg, expected in cases:
        out.fill_(7.0)
        with pytest.raises(hal.InvalidInputError) as info:
            _paged_call(q, cache, table, lens, {"out": out, **over})
        assert info.value.op == "sparse_mla_decode_paged" and info.value.arg == arg, str(info.value)
        assert expected in str(info.value) and info.value.backend == "cpu"
        assert torch.all(out == 7.0), "written before the error"


def test_native_checks_reject_bad_key_ranges():
    q, k, w = torch.ones(2, 3, 8), torch.ones(10, 8), torch.ones(2, 3)
    out = torch.full((2, 4), 7, dtype=torch.int32)

    def call(ks, ke, k=k, out=out):
        ks, ke = torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)
        _C.indexer_topk(out, q, k, None, w, ks, ke, 1)

    call([0, 2], [10, 5])
    out.fill_(7)
    v = native_view
    for kwargs, arg in [(dict(ks=[0, 2], ke=[11, 5]), "k_end"), (dict(ks=[0, 6], ke=[10, 5]), "k_start"),
                        (dict(ks=[-1, 0], ke=[10, 5]), "k_start"),
                        (dict(ks=[0, 0], ke=[10, 5], k=v(k, size=(9, 8))), "k_end"),
                        (dict(ks=[0, 0], ke=[1, 1], k=v(k, stride=(7, 1))), "k"),
                        (dict(ks=[0, 0], ke=[1, 1], k=v(k, dtype=2)), "k"),
                        (dict(ks=[0, 0], ke=[1, 1], k=v(k, dtype=3)), "k_scale"),
                        (dict(ks=[0, 0], ke=[1, 1], out=v(out, size=(2, 0))), "topk")]:
        with pytest.raises(hal.InvalidInputError) as info:
            call(**kwargs)
        assert info.value.op == "indexer_topk" and info.value.arg == arg, str(info.value)
        assert torch.all(out == 7)


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 3), queries=st.integers(1, 3), block_size=st.integers(1, 5), num_blocks=st.integers(0, 6),
       max_blocks=st.integers(0, 4), data=st.data())
def test_fuzz_native_paging_values(batch, queries, block_size, num_blocks, max_blocks, data):
    """The three paged kernels called directly on arbitrary block ids and context lengths:
    they raise InvalidInputError exactly when a used block id or a length is out of range
    (the op layer's value check, repeated natively), and never read outside the cache."""
    capacity = max_blocks * block_size
    table = torch.tensor(data.draw(st.lists(st.lists(st.integers(-3, num_blocks + 2), min_size=max_blocks,
                                                     max_size=max_blocks), min_size=batch, max_size=batch)),
                         dtype=torch.int32).view(batch, max_blocks)
    lens = torch.tensor(data.draw(st.lists(st.integers(-2, capacity + 2), min_size=batch, max_size=batch)),
                        dtype=torch.int32)
    used = (lens.clamp(min=0).long() + block_size - 1) // block_size
    in_use = torch.arange(max_blocks) < used.unsqueeze(-1)
    valid = bool(((lens >= 0) & (lens <= capacity)).all()) and not bool(
        (in_use & ((table < 0) | (table >= num_blocks))).any())
    dim, heads, topk = 8, 2, 3
    cache = torch.randn(num_blocks, block_size, dim)
    q, w = torch.randn(batch, queries, heads, dim), torch.randn(batch, queries, heads)
    indices = torch.randint(-2, capacity + 3, (batch, queries, topk), dtype=torch.int32)
    out = torch.empty(batch, queries, heads, dim)
    lse = torch.empty(batch, queries, heads)
    top = torch.empty(batch, queries, topk, dtype=torch.int32)
    calls = [
        lambda: _C.sparse_mla_decode_paged(out, lse, q, cache, table, lens, indices, 0.3, 2),
        lambda: _C.dense_mla_decode_paged(out, lse, q, cache, table, lens, 0.3, 2),
        lambda: _C.indexer_topk_paged(top, q, cache, None, w, table, lens, 2),
    ]
    for call in calls:
        if valid:
            call()
        else:
            with pytest.raises(hal.InvalidInputError):
                call()
    if valid:  # and the same answer as the reference on these values
        want = ref.dense_mla_decode_paged(q.double(), cache.double(), table, lens, 0.3, dim)
        got = cpu_dsa.dense_mla_decode_paged(q, cache, table, lens, 0.3, dim)
        assert_attention_close(*got, *want, F32, attention_scales(q, *dense_rows(cache, table, lens, queries), 0.3, dim))


# -- fuzzing through the public ops -----------------------------------------------------------
def _call_checked(op, args, reference_args):
    """Runs the public op pinned to cpu: returns its output, or None after the expected
    InvalidInputError when `reference_args` is None (an invalid call)."""
    with hal.use("cpu"):
        if reference_args is None:
            with pytest.raises(hal.InvalidInputError):
                getattr(hal.ops, op)(*args)
            return None
        return getattr(hal.ops, op)(*args)


MUTATIONS = ["none", "dtype", "shape", "range", "topk"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(0, 6), heads=st.integers(1, 20), dim=st.integers(1, 40), keys=st.integers(0, 80),
       topk=st.integers(1, 90), dtype=st.sampled_from(DTYPES), fp8=st.booleans(), mutation=st.sampled_from(MUTATIONS),
       seed=st.integers(0, 2**31 - 1))
def test_fuzz_indexer(tokens, heads, dim, keys, topk, dtype, fp8, mutation, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, w, ks, ke = indexer_inputs(g, dtype, tokens, heads, dim, keys, fp8=fp8)
    valid = mutation == "none"
    if mutation == "dtype":
        w = w.double()
    elif mutation == "shape":
        q = q[..., :-1] if dim > 1 else q.unsqueeze(-1)
    elif mutation == "range":
        assume(tokens > 0)
        ke = ke.clone()
        ke[-1] = keys + 1
    elif mutation == "topk":
        topk = 0
    logits_valid = mutation in ("none", "topk")  # topk is not an argument of indexer_logits
    logits = _call_checked("indexer_logits", (q, k, w, ks, ke), True if logits_valid else None)
    top = _call_checked("indexer_topk", (q, k, w, ks, ke, topk), True if valid else None)
    if logits_valid:
        expected = ref.indexer_logits(q.double(), upcast(k), w.double(), ks, ke)
        scale = logits_scale(q, k, w, ks, ke)
        assert_logits_close(logits, expected, scale)
        if valid:
            assert_topk_valid(top, expected, scale, ks, ke, topk)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(0, 3), queries=st.integers(1, 3), heads=st.integers(1, 20), dim=st.integers(1, 40),
       block_size=st.integers(1, 9), lens=st.lists(st.integers(0, 60), min_size=3, max_size=3),
       topk=st.integers(1, 70), dtype=st.sampled_from(DTYPES), fp8=st.booleans(),
       mutation=st.sampled_from(["none", "context_lens", "block_table", "shape"]), seed=st.integers(0, 2**31 - 1))
def test_fuzz_indexer_paged(batch, queries, heads, dim, block_size, lens, topk, dtype, fp8, mutation, seed):
    g = torch.Generator().manual_seed(seed)
    lens = lens[:batch]
    table, context_lens, nb = make_paging(g, lens, block_size)
    cachef = torch.randn(nb, block_size, dim, generator=g)
    cache = fp8_rows(cachef) if fp8 else cachef.to(dtype)
    q = randn(g, batch, queries, heads, dim, dtype=dtype)
    w = torch.randn(batch, queries, heads, generator=g)
    if mutation == "context_lens":
        assume(batch > 0)
        context_lens = context_lens.clone()
        context_lens[0] = table.shape[1] * block_size + 1
    elif mutation == "block_table":
        assume(batch > 0 and lens[0] > 0)
        table = table.clone()
        table[0, 0] = nb
    elif mutation == "shape":
        w = w[..., :-1] if heads > 1 else w.unsqueeze(-1)
    args = (q, cache, w, table, context_lens, topk)
    out = _call_checked("indexer_topk_paged", args, True if mutation == "none" else None)
    if out is not None:
        want = ref.indexer_topk_paged(q.double(), upcast(cache), w.double(), table, context_lens, topk)
        assert out.shape == want.shape and torch.equal((out >= 0).sum(-1), (want >= 0).sum(-1))
        visible = (context_lens.view(-1, 1) - queries + torch.arange(queries) + 1).clamp(min=0)
        assert bool(((out < visible.unsqueeze(-1)) | (out == -1)).all())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(0, 5), heads=st.integers(1, 40), dqk=st.integers(1, 70), keys=st.integers(0, 60),
       topk=st.integers(1, 80), dv_frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES),
       mutation=st.sampled_from(["none", "d_v", "sm_scale", "indices_dtype", "kv_shape"]),
       seed=st.integers(0, 2**31 - 1))
def test_fuzz_sparse_mla_attention(tokens, heads, dqk, keys, topk, dv_frac, dtype, mutation, seed):
    g = torch.Generator().manual_seed(seed)
    d_v = max(1, round(dv_frac * dqk))
    q, kv = randn(g, tokens, heads, dqk, dtype=dtype), randn(g, keys, dqk, dtype=dtype)
    indices = torch.randint(-5, keys + 5, (tokens, topk), generator=g, dtype=torch.int32)
    sm_scale = 0.2
    if mutation == "d_v":
        d_v = dqk + 1
    elif mutation == "sm_scale":
        sm_scale = 0.0
    elif mutation == "indices_dtype":
        indices = indices.long()
    elif mutation == "kv_shape":
        kv = randn(g, keys, dqk + 1, dtype=dtype)
    args = (q, kv, indices, sm_scale, d_v)
    got = _call_checked("sparse_mla_attention", args, True if mutation == "none" else None)
    if got is not None:
        want = ref.sparse_mla_attention(q.double(), kv.double(), indices, sm_scale, d_v)
        assert_attention_close(*got, *want, dtype, attention_scales(q, *sparse_rows(kv, indices), sm_scale, d_v))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(0, 3), queries=st.integers(1, 3), heads=st.integers(1, 20), dqk=st.integers(1, 50),
       block_size=st.integers(1, 9), lens=st.lists(st.integers(0, 50), min_size=3, max_size=3),
       topk=st.integers(1, 60), dtype=st.sampled_from(DTYPES),
       mutation=st.sampled_from(["none", "context_lens", "block_table", "cache_dtype"]), seed=st.integers(0, 2**31 - 1))
def test_fuzz_paged_decode(batch, queries, heads, dqk, block_size, lens, topk, dtype, mutation, seed):
    g = torch.Generator().manual_seed(seed)
    lens = lens[:batch]
    table, context_lens, nb = make_paging(g, lens, block_size)
    cache = randn(g, nb, block_size, dqk, dtype=dtype)
    q = randn(g, batch, queries, heads, dqk, dtype=dtype)
    indices = torch.randint(-3, 55, (batch, queries, topk), generator=g, dtype=torch.int32)
    if mutation == "context_lens":
        assume(batch > 0)
        context_lens = context_lens.clone()
        context_lens[-1] = -1
    elif mutation == "block_table":
        assume(batch > 0 and lens[-1] > 0)
        table = table.clone()
        table[-1, 0] = -2
    elif mutation == "cache_dtype":
        cache = cache.to(F32 if dtype != F32 else F16)
    d_v = max(1, dqk // 2)
    sparse = _call_checked("sparse_mla_decode_paged", (q, cache, table, context_lens, indices, 0.15, d_v),
                           True if mutation == "none" else None)
    dense = _call_checked("dense_mla_decode_paged", (q, cache, table, context_lens, 0.15, d_v),
                          True if mutation == "none" else None)
    if mutation == "none":
        qd, cd = q.double(), cache.double()
        rows = paged_sparse_rows(cache, table, context_lens, indices)
        assert_attention_close(*sparse, *ref.sparse_mla_decode_paged(qd, cd, table, context_lens, indices, 0.15, d_v),
                               dtype, attention_scales(q, *rows, 0.15, d_v))
        rows = dense_rows(cache, table, context_lens, queries)
        assert_attention_close(*dense, *ref.dense_mla_decode_paged(qd, cd, table, context_lens, 0.15, d_v), dtype,
                               attention_scales(q, *rows, 0.15, d_v))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_keys", "fp8_keys"])
def test_glm5_decode_step_at_8k_context(fp8):
    """The GLM-5 DSA decode step end to end at a long context: indexer top-2048 over 8K keys,
    then sparse attention over the selected rows, against the reference on the same inputs."""
    g = gen("glm5-step", fp8)
    lens = [8192, 5000]
    table, context_lens, nb = make_paging(g, lens, 64)
    kc = torch.randn(nb, 64, 128, generator=g)
    k_cache = fp8_rows(kc) if fp8 else kc.to(BF16)
    q_idx = randn(g, 2, 1, 32, 128, dtype=BF16)
    w = torch.randn(2, 1, 32, generator=g) * 32 ** -0.5
    top = cpu_dsa.indexer_topk_paged(q_idx, k_cache, w, table, context_lens, 2048)
    assert torch.equal((top >= 0).sum(-1), torch.tensor([[2048], [2048]]))
    kv = randn(g, nb, 64, 576, dtype=BF16)
    q = randn(g, 2, 1, 64, 576, dtype=BF16)
    out, lse = cpu_dsa.sparse_mla_decode_paged(q, kv, table, context_lens, top, 256 ** -0.5, 512)
    ref_out, ref_lse = ref.sparse_mla_decode_paged(q.double(), kv.double(), table, context_lens, top, 256 ** -0.5, 512)
    rows = paged_sparse_rows(kv, table, context_lens, top)
    assert_attention_close(out, lse, ref_out, ref_lse, BF16, attention_scales(q, *rows, 256 ** -0.5, 512))
