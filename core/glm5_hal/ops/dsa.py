"""DSA ops (OPS.md section 4): the lightning indexer (logits, top-k, paged top-k) and MLA
attention in absorbed (MQA) mode over sparse indices, sparse paged decode and dense paged
decode. The public functions and their contracts."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import checks as C
from .. import reference as ref
from ..registry import OpDef, define

__all__ = [
    "indexer_logits",
    "indexer_topk",
    "indexer_topk_paged",
    "sparse_mla_attention",
    "sparse_mla_decode_paged",
    "dense_mla_decode_paged",
]

Key = "Tensor | tuple[Tensor, Tensor]"


# -- helpers ---------------------------------------------------------------------------------
def _is_pair(k: object) -> bool:
    return isinstance(k, (tuple, list))


def _split_key(op: str, arg: str, k: object) -> tuple[object, object]:
    """The torch-schema form `(values, scale | None)` of a key argument."""
    if _is_pair(k):
        if len(k) != 2:
            C.fail(op, arg, "a tensor or a pair (fp8 values, float32 scale)",
                   f"a {type(k).__name__} of length {len(k)}")
        return k[0], k[1]
    return k, None


def _join_key(values: Tensor, scale: Tensor | None):
    return values if scale is None else (values, scale)


def _key_values(k) -> Tensor:
    return k[0] if _is_pair(k) else k


def _check_head_dims(op: str, arg: str, t: Tensor, layout: str, first: int) -> None:
    """Every dim of `t` from `first` on is >= 1 (head counts, head dims, N)."""
    if any(n < 1 for n in t.shape[first:]):
        names = layout.strip("[]").split(", ")[first:]
        C.fail(op, arg, f"{' and '.join(names)} >= 1 in shape {layout}", f"shape {list(t.shape)}")


def _check_keys(op: str, arg: str, scale_arg: str, k, q: Tensor, layout: str, dim: int) -> Tensor:
    """`k` is a float tensor of q's dtype with `layout` ([S, D] or [num_blocks, block_size, D])
    or an FP8 pair (values float8_e4m3fn of that layout, float32 scale without the last dim);
    its last dim is `dim`. Returns the values tensor."""
    ndim = layout.count(",") + 1
    values, scale = _split_key(op, arg, k)
    if scale is None:
        C.tensor(op, arg, values, ndim=ndim)
        if values.dtype == C.FP8:
            C.fail(op, arg, f"a float tensor {layout}, or FP8 keys as a pair "
                   f"(float8_e4m3fn {layout}, float32 scale)", "a bare float8_e4m3fn tensor")
        C.same_dtype(op, "q", q, arg, values)
    else:
        C.tensor(op, arg, values, ndim=ndim, dtypes=(C.FP8,))
        C.tensor(op, scale_arg, scale, ndim=ndim - 1, dtypes=(torch.float32,))
        C.shape(op, scale_arg, scale, list(values.shape[:-1]))
    C.same_device(op, "q", q, **{arg: values, scale_arg: scale})
    if values.shape[-1] != dim:
        C.fail(op, arg, f"last dim {dim} (the head dim of 'q')", f"shape {list(values.shape)}")
    return values


def _check_index(op: str, arg: str, t: Tensor, q: Tensor, expected: list, layout: str) -> None:
    C.tensor(op, arg, t, ndim=len(expected), dtypes=C.INDEX_DTYPES)
    for a, e in zip(t.shape, expected):  # a plain loop: this runs on every call
        if e is not None and a != e:
            shown = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
            C.fail(op, arg, f"shape {layout} = {shown}", f"shape {list(t.shape)}")
    C.same_device(op, "q", q, **{arg: t})


def _check_topk(op: str, topk: object) -> None:
    C.integer(op, "topk", topk, min_value=1)


def _check_cache(op: str, arg: str, cache: Tensor) -> None:
    if cache.shape[1] < 1:
        C.fail(op, arg, "block_size >= 1 in shape [num_blocks, block_size, D]", f"shape {list(cache.shape)}")


def _check_paging(op: str, q: Tensor, block_table: Tensor, context_lens: Tensor) -> None:
    batch = q.shape[0]
    _check_index(op, "block_table", block_table, q, [batch, None], "[B, max_blocks]")
    _check_index(op, "context_lens", context_lens, q, [batch], "[B]")


def _check_paging_values(op: str, cache: Tensor, block_table: Tensor, context_lens: Tensor) -> None:
    """context_lens[b] fits the block table, and the block ids holding [0, context_lens[b])
    name existing blocks; entries past the used blocks are padding and never read."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    max_blocks = block_table.shape[1]
    capacity = max_blocks * block_size
    lens = context_lens.long()
    bad = (lens < 0) | (lens > capacity)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        C.fail(op, "context_lens", f"values in [0, {capacity}] (max_blocks {max_blocks} * block_size "
               f"{block_size})", f"{int(lens[b])} for sequence {b}")
    used = (lens + block_size - 1) // block_size
    in_use = torch.arange(max_blocks, device=lens.device) < used.unsqueeze(-1)
    bad = in_use & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        C.fail(op, "block_table", f"block ids in [0, {num_blocks}) for the blocks holding "
               f"[0, context_lens[b])", f"{int(block_table[b, j])} at [{b}, {j}] "
               f"(context_lens[{b}] = {int(lens[b])})")


def _check_attention_scalars(op: str, sm_scale: object, d_v: object, dqk: int) -> None:
    if isinstance(sm_scale, (int, float)) and not isinstance(sm_scale, bool) and math.isinf(sm_scale):
        C.fail(op, "sm_scale", "a finite number > 0", repr(sm_scale))
    C.number(op, "sm_scale", sm_scale, min_value=0.0, exclusive_min=True)
    C.integer(op, "d_v", d_v, min_value=1)
    if d_v > dqk:
        C.fail(op, "d_v", f"an int in [1, {dqk}] (Dqk, the last dim of 'q')", d_v)


# -- indexer_logits --------------------------------------------------------------------------
def _check_indexer(op, q, k, weights, k_start, k_end):
    C.tensor(op, "q", q, ndim=3, dtypes=C.FLOAT_DTYPES)
    _check_head_dims(op, "q", q, "[T, Hi, D]", 1)
    tokens, heads, dim = q.shape
    _check_keys(op, "k", "k_scale", k, q, "[S, D]", dim)
    C.tensor(op, "weights", weights, ndim=2, dtypes=(torch.float32,))
    C.shape(op, "weights", weights, [tokens, heads])
    C.same_device(op, "q", q, weights=weights)
    _check_index(op, "k_start", k_start, q, [tokens], "[T]")
    _check_index(op, "k_end", k_end, q, [tokens], "[T]")


def _check_indexer_values(op, k, k_start, k_end):
    """0 <= k_start[t] <= k_end[t] <= S."""
    num_keys = _key_values(k).shape[0]
    start, end = k_start.long(), k_end.long()
    bad = (end < 0) | (end > num_keys)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        C.fail(op, "k_end", f"values in [0, {num_keys}] (S, the number of keys)", f"{int(end[t])} at t={t}")
    bad = (start < 0) | (start > end)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        C.fail(op, "k_start", "0 <= k_start[t] <= k_end[t]",
               f"k_start[{t}] = {int(start[t])} with k_end[{t}] = {int(end[t])}")


def _check_indexer_logits(q, k, weights, k_start, k_end):
    _check_indexer("indexer_logits", q, k, weights, k_start, k_end)


_INDEXER_LOGITS = define(OpDef(
    name="indexer_logits",
    schema="(Tensor q, Tensor k, Tensor? k_scale, Tensor weights, Tensor k_start, Tensor k_end) -> Tensor",
    reference=ref.indexer_logits,
    check=_check_indexer_logits,
    check_values=lambda q, k, weights, k_start, k_end: _check_indexer_values(
        "indexer_logits", k, k_start, k_end),
    fake=lambda q, k, weights, k_start, k_end: q.new_empty(
        (q.shape[0], _key_values(k).shape[0]), dtype=torch.float32),
    dispatch_arg="q",
    key_extra=lambda q, k, *rest: (_is_pair(k),),
    to_torch=lambda q, k, weights, k_start, k_end: (
        q, *_split_key("indexer_logits", "k", k), weights, k_start, k_end),
    from_torch=lambda q, k, k_scale, weights, k_start, k_end: (
        q, _join_key(k, k_scale), weights, k_start, k_end),
    differentiable=True,
))


def indexer_logits(q: Tensor, k: Key, weights: Tensor, k_start: Tensor, k_end: Tensor) -> Tensor:
    """Lightning-indexer scores of every key for every query token.

    q:       [T, Hi, D] bfloat16 | float16 | float32 (indexer queries, after rope/Hadamard)
    k:       [S, D] of q's dtype, or an FP8 pair (k_fp8 float8_e4m3fn [S, D], k_scale float32 [S])
             meaning k_fp8.float() * k_scale[:, None]
    weights: [T, Hi] float32 (per-head weights with every scale folded in)
    k_start, k_end: [T] int32, 0 <= k_start[t] <= k_end[t] <= S
    returns  [T, S] float32: sum_h weights[t, h] * relu(q[t, h] . k[s]) for
             k_start[t] <= s < k_end[t], -inf elsewhere.
    Differentiable in q, k (float keys) and weights.
    """
    return _INDEXER_LOGITS(q, k, weights, k_start, k_end)


# -- indexer_topk ----------------------------------------------------------------------------
def _check_indexer_topk(q, k, weights, k_start, k_end, topk):
    _check_indexer("indexer_topk", q, k, weights, k_start, k_end)
    _check_topk("indexer_topk", topk)


_INDEXER_TOPK = define(OpDef(
    name="indexer_topk",
    schema="(Tensor q, Tensor k, Tensor? k_scale, Tensor weights, Tensor k_start, Tensor k_end, "
           "int topk) -> Tensor",
    reference=ref.indexer_topk,
    check=_check_indexer_topk,
    check_values=lambda q, k, weights, k_start, k_end, topk: _check_indexer_values(
        "indexer_topk", k, k_start, k_end),
    fake=lambda q, k, weights, k_start, k_end, topk: q.new_empty((q.shape[0], topk), dtype=torch.int32),
    dispatch_arg="q",
    key_extra=lambda q, k, *rest: (_is_pair(k),),
    to_torch=lambda q, k, weights, k_start, k_end, topk: (
        q, *_split_key("indexer_topk", "k", k), weights, k_start, k_end, topk),
    from_torch=lambda q, k, k_scale, weights, k_start, k_end, topk: (
        q, _join_key(k, k_scale), weights, k_start, k_end, topk),
))


def indexer_topk(q: Tensor, k: Key, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    """Key positions of the `topk` largest `indexer_logits` of each query token.

    Arguments as `indexer_logits`, plus topk: int >= 1.
    returns [T, topk] int32: positions in [k_start[t], k_end[t]), left-packed, padded with -1
            when the row has fewer than topk keys in range (also when topk > S). The order
            among valid entries is unspecified.
    """
    return _INDEXER_TOPK(q, k, weights, k_start, k_end, topk)


# -- indexer_topk_paged ----------------------------------------------------------------------
def _check_indexer_topk_paged(q, k_cache, weights, block_table, context_lens, topk):
    op = "indexer_topk_paged"
    C.tensor(op, "q", q, ndim=4, dtypes=C.FLOAT_DTYPES)
    _check_head_dims(op, "q", q, "[B, N, Hi, D]", 1)
    batch, queries, heads, dim = q.shape
    cache = _check_keys(op, "k_cache", "k_cache_scale", k_cache, q, "[num_blocks, block_size, D]", dim)
    _check_cache(op, "k_cache", cache)
    C.tensor(op, "weights", weights, ndim=3, dtypes=(torch.float32,))
    C.shape(op, "weights", weights, [batch, queries, heads])
    C.same_device(op, "q", q, weights=weights)
    _check_paging(op, q, block_table, context_lens)
    _check_topk(op, topk)


_INDEXER_TOPK_PAGED = define(OpDef(
    name="indexer_topk_paged",
    schema="(Tensor q, Tensor k_cache, Tensor? k_cache_scale, Tensor weights, Tensor block_table, "
           "Tensor context_lens, int topk) -> Tensor",
    reference=ref.indexer_topk_paged,
    check=_check_indexer_topk_paged,
    check_values=lambda q, k_cache, weights, block_table, context_lens, topk: _check_paging_values(
        "indexer_topk_paged", _key_values(k_cache), block_table, context_lens),
    fake=lambda q, k_cache, weights, block_table, context_lens, topk: q.new_empty(
        (q.shape[0], q.shape[1], topk), dtype=torch.int32),
    dispatch_arg="q",
    key_extra=lambda q, k_cache, *rest: (_is_pair(k_cache),),
    to_torch=lambda q, k_cache, weights, block_table, context_lens, topk: (
        q, *_split_key("indexer_topk_paged", "k_cache", k_cache), weights, block_table, context_lens, topk),
    from_torch=lambda q, k_cache, k_cache_scale, weights, block_table, context_lens, topk: (
        q, _join_key(k_cache, k_cache_scale), weights, block_table, context_lens, topk),
))


def indexer_topk_paged(q: Tensor, k_cache: Key, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    """Indexer top-k for decode over a paged key cache, N query tokens per sequence.

    q:            [B, N, Hi, D] bfloat16 | float16 | float32 (N > 1 for MTP / speculative decode)
    k_cache:      [num_blocks, block_size, D] of q's dtype, or an FP8 pair
                  (float8_e4m3fn [num_blocks, block_size, D], float32 [num_blocks, block_size])
    weights:      [B, N, Hi] float32
    block_table:  [B, max_blocks] int32; the entries of the blocks holding [0, context_lens[b])
                  are in [0, num_blocks), later entries are ignored (e.g. -1 padding)
    context_lens: [B] int32 in [0, max_blocks * block_size]
    topk:         int >= 1
    returns [B, N, topk] int32: logical positions of the topk largest indexer logits of query i
            of sequence b over [0, context_lens[b] - N + i + 1) (empty when that is <= 0),
            left-packed, -1 padded.
    """
    return _INDEXER_TOPK_PAGED(q, k_cache, weights, block_table, context_lens, topk)


# -- sparse_mla_attention --------------------------------------------------------------------
def _check_sparse_mla_attention(q, kv, indices, sm_scale, d_v):
    op = "sparse_mla_attention"
    C.tensor(op, "q", q, ndim=3, dtypes=C.FLOAT_DTYPES)
    _check_head_dims(op, "q", q, "[T, H, Dqk]", 1)
    tokens, _, dqk = q.shape
    C.tensor(op, "kv", kv, ndim=2)
    C.same_dtype(op, "q", q, "kv", kv)
    C.shape(op, "kv", kv, [None, dqk])
    C.same_device(op, "q", q, kv=kv)
    _check_index(op, "indices", indices, q, [tokens, None], "[T, topk]")
    _check_head_dims(op, "indices", indices, "[T, topk]", 1)
    _check_attention_scalars(op, sm_scale, d_v, dqk)


def _attention_fake(q, d_v, lead):
    return q.new_empty((*lead, q.shape[-2], d_v)), q.new_empty((*lead, q.shape[-2]), dtype=torch.float32)


_SPARSE_MLA_ATTENTION = define(OpDef(
    name="sparse_mla_attention",
    schema="(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v) -> (Tensor, Tensor)",
    reference=ref.sparse_mla_attention,
    check=_check_sparse_mla_attention,
    fake=lambda q, kv, indices, sm_scale, d_v: _attention_fake(q, d_v, q.shape[:1]),
    dispatch_arg="q",
    differentiable=True,
))


def sparse_mla_attention(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                         d_v: int = 512) -> tuple[Tensor, Tensor]:
    """MLA attention (absorbed / MQA mode, one latent KV head) over top-k selected rows.

    q:       [T, H, Dqk] bfloat16 | float16 | float32 (GLM-5: Dqk = 576)
    kv:      [S, Dqk] of q's dtype; values are the first d_v dims of each row
    indices: [T, topk] int32, topk >= 1; entries outside [0, S) (e.g. -1) are ignored,
             duplicates count once per occurrence
    sm_scale: float > 0, always explicit (GLM-5: 256 ** -0.5)
    d_v:     int in [1, Dqk] (GLM-5: 512)
    returns (out [T, H, d_v] like q, lse [T, H] float32): z_j = sm_scale * q[t, h] . kv[idx_j]
            over the valid entries, out = softmax(z) @ kv[idx, :d_v], lse = logsumexp(z)
            (natural log); a row with no valid entry gives out 0 and lse -inf.
    Differentiable in q and kv.
    """
    return _SPARSE_MLA_ATTENTION(q, kv, indices, sm_scale, d_v)


# -- sparse_mla_decode_paged -----------------------------------------------------------------
def _check_decode(op, q, kv_cache, block_table, context_lens, sm_scale, d_v):
    C.tensor(op, "q", q, ndim=4, dtypes=C.FLOAT_DTYPES)
    _check_head_dims(op, "q", q, "[B, N, H, Dqk]", 1)
    dqk = q.shape[3]
    C.tensor(op, "kv_cache", kv_cache, ndim=3)
    C.same_dtype(op, "q", q, "kv_cache", kv_cache)
    C.shape(op, "kv_cache", kv_cache, [None, None, dqk])
    C.same_device(op, "q", q, kv_cache=kv_cache)
    _check_cache(op, "kv_cache", kv_cache)
    _check_paging(op, q, block_table, context_lens)
    _check_attention_scalars(op, sm_scale, d_v, dqk)


def _check_sparse_mla_decode_paged(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v):
    op = "sparse_mla_decode_paged"
    _check_decode(op, q, kv_cache, block_table, context_lens, sm_scale, d_v)
    _check_index(op, "indices", indices, q, [q.shape[0], q.shape[1], None], "[B, N, topk]")
    _check_head_dims(op, "indices", indices, "[B, N, topk]", 2)


_SPARSE_MLA_DECODE_PAGED = define(OpDef(
    name="sparse_mla_decode_paged",
    schema="(Tensor q, Tensor kv_cache, Tensor block_table, Tensor context_lens, Tensor indices, "
           "float sm_scale, int d_v) -> (Tensor, Tensor)",
    reference=ref.sparse_mla_decode_paged,
    check=_check_sparse_mla_decode_paged,
    check_values=lambda q, kv_cache, block_table, context_lens, indices, sm_scale, d_v: _check_paging_values(
        "sparse_mla_decode_paged", kv_cache, block_table, context_lens),
    fake=lambda q, kv_cache, block_table, context_lens, indices, sm_scale, d_v: _attention_fake(
        q, d_v, q.shape[:2]),
    dispatch_arg="q",
))


def sparse_mla_decode_paged(q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                            indices: Tensor, sm_scale: float, d_v: int = 512) -> tuple[Tensor, Tensor]:
    """Sparse MLA decode over a paged latent cache, N query tokens per sequence.

    q:            [B, N, H, Dqk] bfloat16 | float16 | float32
    kv_cache:     [num_blocks, block_size, Dqk] of q's dtype (rows cat(c_kv, k_pe))
    block_table:  [B, max_blocks] int32 (entries past the blocks in use are ignored)
    context_lens: [B] int32 in [0, max_blocks * block_size]
    indices:      [B, N, topk] int32 logical positions; valid iff 0 <= p < context_lens[b],
                  others ignored; duplicates count once per occurrence
    sm_scale, d_v: as `sparse_mla_attention`
    returns (out [B, N, H, d_v] like q, lse [B, N, H] float32), as `sparse_mla_attention`
            on each sequence's logical rows.
    """
    return _SPARSE_MLA_DECODE_PAGED(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v)


# -- dense_mla_decode_paged ------------------------------------------------------------------
def _check_dense_mla_decode_paged(q, kv_cache, block_table, context_lens, sm_scale, d_v):
    _check_decode("dense_mla_decode_paged", q, kv_cache, block_table, context_lens, sm_scale, d_v)


_DENSE_MLA_DECODE_PAGED = define(OpDef(
    name="dense_mla_decode_paged",
    schema="(Tensor q, Tensor kv_cache, Tensor block_table, Tensor context_lens, float sm_scale, "
           "int d_v) -> (Tensor, Tensor)",
    reference=ref.dense_mla_decode_paged,
    check=_check_dense_mla_decode_paged,
    check_values=lambda q, kv_cache, block_table, context_lens, sm_scale, d_v: _check_paging_values(
        "dense_mla_decode_paged", kv_cache, block_table, context_lens),
    fake=lambda q, kv_cache, block_table, context_lens, sm_scale, d_v: _attention_fake(q, d_v, q.shape[:2]),
    dispatch_arg="q",
))


def dense_mla_decode_paged(q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                           sm_scale: float, d_v: int = 512) -> tuple[Tensor, Tensor]:
    """Dense MLA decode over a paged latent cache (the baseline sparse decode must match).

    Arguments as `sparse_mla_decode_paged` without `indices`.
    returns (out [B, N, H, d_v] like q, lse [B, N, H] float32): query i of N attends logical
            positions [0, context_lens[b] - N + i + 1) (nothing when that is <= 0: out 0, lse -inf).
    """
    return _DENSE_MLA_DECODE_PAGED(q, kv_cache, block_table, context_lens, sm_scale, d_v)
