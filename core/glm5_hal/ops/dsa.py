"""DSA ops (docs/ops/dsa.md): the lightning indexer (logits, top-k, paged top-k) and MLA
attention in absorbed (MQA) mode over sparse indices, sparse paged decode and dense paged
decode."""
from __future__ import annotations

import torch

from .. import checks as C
from .. import reference as ref
from ..checks import FLOAT_DTYPES as FLOAT, INDEX_DTYPES as INDEX
from ..contract import Fp8Pair, Int, Number, Out, Rule, Tensor
from ..opdef import define, defined_in

F32 = (torch.float32,)


def _key_values(k):
    return k[0] if isinstance(k, (tuple, list)) else k


def _nonempty(arg: str, layout: str, dims: str) -> Rule:
    """The named dims of `arg` (layout "[T, Hi, D]") are >= 1."""
    names = [d.strip() for d in dims.split(",")]
    return Rule(arg, " and ".join(f"{d} >= 1" for d in names),
                f"{' and '.join(names)} >= 1 in shape {layout}")


def _index(layout: str) -> Tensor:
    """An int32 index tensor whose shape errors name its layout's dims."""
    return Tensor(layout, INDEX, layout=True)


def _attention_scalars() -> dict:
    return dict(sm_scale=Number(gt=0.0), d_v=Int(min=1))


_D_V = Rule("d_v", "d_v <= Dqk", "an int in [1, {Dqk}] (Dqk, the last dim of 'q')")
_CACHE = _nonempty("kv_cache", "[num_blocks, block_size, Dqk]", "block_size")


def _attention_fake(q, d_v, lead):
    return q.new_empty((*lead, q.shape[-2], d_v)), q.new_empty((*lead, q.shape[-2]), dtype=torch.float32)


# -- value checks (data-dependent; glm5_hal.opdef.define says when they run) -------------------
def _check_paging_values(op: str, cache: torch.Tensor, block_table: torch.Tensor,
                         context_lens: torch.Tensor) -> None:
    """context_lens[b] fits the block table, and the block ids holding [0, context_lens[b])
    name existing blocks; entries past the used blocks are padding and never read."""
    shape = cache.shape   # each .shape read builds a torch.Size: once
    num_blocks, block_size = shape[0], shape[1]
    kind, b, j = C.first_bad_paging(block_table, context_lens, block_size, num_blocks)
    if kind == 1:
        max_blocks = block_table.shape[1]
        C.fail(op, "context_lens", f"values in [0, {max_blocks * block_size}] (max_blocks {max_blocks} * "
               f"block_size {block_size})", f"{int(context_lens[b])} for sequence {b}")
    if kind == 2:
        C.fail(op, "block_table", f"block ids in [0, {num_blocks}) for the blocks holding "
               f"[0, context_lens[b])", f"{int(block_table[b, j])} at [{b}, {j}] "
               f"(context_lens[{b}] = {int(context_lens[b])})")


def _check_indexer_values(op, k, k_start, k_end):
    """0 <= k_start[t] <= k_end[t] <= S."""
    num_keys = _key_values(k).shape[0]
    kind, t = C.first_bad_range(k_start, k_end, num_keys)
    if kind == 1:
        C.fail(op, "k_end", f"values in [0, {num_keys}] (S, the number of keys)", f"{int(k_end[t])} at t={t}")
    if kind == 2:
        C.fail(op, "k_start", "0 <= k_start[t] <= k_end[t]",
               f"k_start[{t}] = {int(k_start[t])} with k_end[{t}] = {int(k_end[t])}")


# -- the indexer ------------------------------------------------------------------------------
_INDEXER_ARGS = dict(q=Tensor("T, Hi, D", FLOAT), k=Fp8Pair("S, D", like="q"), weights=Tensor("T, Hi", F32),
                     k_start=_index("T"), k_end=_index("T"))
_INDEXER_RULES = [_nonempty("q", "[T, Hi, D]", "Hi, D")]

indexer_logits = define(
    ref.indexer_logits,
    args=_INDEXER_ARGS,
    rules=_INDEXER_RULES,
    check_values=lambda q, k, weights, k_start, k_end: _check_indexer_values(
        "indexer_logits", k, k_start, k_end),
    fake=lambda q, k, weights, k_start, k_end: q.new_empty(
        (q.shape[0], _key_values(k).shape[0]), dtype=torch.float32),
    differentiable=True,
    doc="""Lightning-indexer scores of every key for every query token.

    q:       [T, Hi, D] bfloat16 | float16 | float32 (indexer queries, after rope/Hadamard)
    k:       [S, D] of q's dtype, or an FP8 pair (k_fp8 float8_e4m3fn [S, D], k_scale float32 [S])
             meaning k_fp8.float() * k_scale[:, None]
    weights: [T, Hi] float32 (per-head weights with every scale folded in)
    k_start, k_end: [T] int32, 0 <= k_start[t] <= k_end[t] <= S
    returns  [T, S] float32: sum_h weights[t, h] * relu(q[t, h] . k[s]) for
             k_start[t] <= s < k_end[t], -inf elsewhere.
    Differentiable in q, k (float keys) and weights.
    """)

indexer_topk = define(
    ref.indexer_topk,
    args=dict(_INDEXER_ARGS, topk=Int(min=1)),
    rules=_INDEXER_RULES,
    check_values=lambda q, k, weights, k_start, k_end, topk: _check_indexer_values(
        "indexer_topk", k, k_start, k_end),
    fake=lambda q, k, weights, k_start, k_end, topk: q.new_empty((q.shape[0], topk), dtype=torch.int32),
    doc="""Key positions of the `topk` largest `indexer_logits` of each query token.

    Arguments as `indexer_logits`, plus topk: int >= 1.
    returns [T, topk] int32: positions in [k_start[t], k_end[t]), left-packed, padded with -1
            when the row has fewer than topk keys in range (also when topk > S). The order
            among valid entries is unspecified.
    """)

indexer_topk_paged = define(
    ref.indexer_topk_paged,
    args=dict(q=Tensor("B, N, Hi, D", FLOAT), k_cache=Fp8Pair("num_blocks, block_size, D", like="q"),
              weights=Tensor("B, N, Hi", F32), block_table=_index("B, max_blocks"),
              context_lens=_index("B"), topk=Int(min=1)),
    rules=[_nonempty("q", "[B, N, Hi, D]", "N, Hi, D"),
           _nonempty("k_cache", "[num_blocks, block_size, D]", "block_size")],
    check_values=lambda q, k_cache, weights, block_table, context_lens, topk: _check_paging_values(
        "indexer_topk_paged", _key_values(k_cache), block_table, context_lens),
    fake=lambda q, k_cache, weights, block_table, context_lens, topk: q.new_empty(
        (q.shape[0], q.shape[1], topk), dtype=torch.int32),
    out=Out("B, N, topk", dtype=torch.int32),
    doc="""Indexer top-k for decode over a paged key cache, N query tokens per sequence.

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
    out:          optional [B, N, topk] int32 buffer (a serving engine's shared top-k buffer),
                  written and returned (docs/ops.md, "out= buffers").
    """)

# -- MLA attention ----------------------------------------------------------------------------
sparse_mla_attention = define(
    ref.sparse_mla_attention,
    args=dict(q=Tensor("T, H, Dqk", FLOAT), kv=Tensor("S, Dqk", "q"), indices=_index("T, topk"),
              **_attention_scalars()),
    rules=[_nonempty("q", "[T, H, Dqk]", "H, Dqk"), _nonempty("indices", "[T, topk]", "topk"), _D_V],
    fake=lambda q, kv, indices, sm_scale, d_v: _attention_fake(q, d_v, q.shape[:1]),
    out=Out("T, H, d_v", dtype="q"),
    differentiable=True,
    doc="""MLA attention (absorbed / MQA mode, one latent KV head) over top-k selected rows.

    q:       [T, H, Dqk] bfloat16 | float16 | float32 (GLM-5: Dqk = 576)
    kv:      [S, Dqk] of q's dtype; values are the first d_v dims of each row
    indices: [T, topk] int32, topk >= 1; entries outside [0, S) (e.g. -1) are ignored,
             duplicates count once per occurrence
    sm_scale: float > 0, always explicit (GLM-5: 256 ** -0.5)
    d_v:     int in [1, Dqk] (GLM-5: 512)
    returns (out [T, H, d_v] like q, lse [T, H] float32): z_j = sm_scale * q[t, h] . kv[idx_j]
            over the valid entries, out = softmax(z) @ kv[idx, :d_v], lse = logsumexp(z)
            (natural log); a row with no valid entry gives out 0 and lse -inf.
    out:     optional [T, H, d_v] buffer of q's dtype for the first result, written and
             returned as it (lse is returned fresh; docs/ops.md, "out= buffers").
    Differentiable in q and kv.
    """)

_DECODE_ARGS = dict(q=Tensor("B, N, H, Dqk", FLOAT), kv_cache=Tensor("num_blocks, block_size, Dqk", "q"),
                    block_table=_index("B, max_blocks"), context_lens=_index("B"))
_DECODE_RULES = [_nonempty("q", "[B, N, H, Dqk]", "N, H, Dqk"), _CACHE, _D_V]

sparse_mla_decode_paged = define(
    ref.sparse_mla_decode_paged,
    args=dict(_DECODE_ARGS, indices=_index("B, N, topk"), **_attention_scalars()),
    rules=[*_DECODE_RULES, _nonempty("indices", "[B, N, topk]", "topk")],
    check_values=lambda q, kv_cache, block_table, context_lens, indices, sm_scale, d_v: _check_paging_values(
        "sparse_mla_decode_paged", kv_cache, block_table, context_lens),
    fake=lambda q, kv_cache, block_table, context_lens, indices, sm_scale, d_v: _attention_fake(
        q, d_v, q.shape[:2]),
    out=Out("B, N, H, d_v", dtype="q"),
    doc="""Sparse MLA decode over a paged latent cache, N query tokens per sequence.

    q:            [B, N, H, Dqk] bfloat16 | float16 | float32
    kv_cache:     [num_blocks, block_size, Dqk] of q's dtype (rows cat(c_kv, k_pe))
    block_table:  [B, max_blocks] int32 (entries past the blocks in use are ignored)
    context_lens: [B] int32 in [0, max_blocks * block_size]
    indices:      [B, N, topk] int32 logical positions; valid iff 0 <= p < context_lens[b],
                  others ignored; duplicates count once per occurrence
    sm_scale, d_v: as `sparse_mla_attention`
    returns (out [B, N, H, d_v] like q, lse [B, N, H] float32), as `sparse_mla_attention`
            on each sequence's logical rows.
    out:          optional [B, N, H, d_v] buffer of q's dtype for the first result (a serving
                  engine's attention output), written and returned as it (lse is returned fresh;
                  docs/ops.md, "out= buffers").
    """)

dense_mla_decode_paged = define(
    ref.dense_mla_decode_paged,
    args=dict(_DECODE_ARGS, **_attention_scalars()),
    rules=_DECODE_RULES,
    check_values=lambda q, kv_cache, block_table, context_lens, sm_scale, d_v: _check_paging_values(
        "dense_mla_decode_paged", kv_cache, block_table, context_lens),
    fake=lambda q, kv_cache, block_table, context_lens, sm_scale, d_v: _attention_fake(q, d_v, q.shape[:2]),
    out=Out("B, N, H, d_v", dtype="q"),
    doc="""Dense MLA decode over a paged latent cache (the baseline sparse decode must match).

    Arguments as `sparse_mla_decode_paged` without `indices`.
    returns (out [B, N, H, d_v] like q, lse [B, N, H] float32): query i of N attends logical
            positions [0, context_lens[b] - N + i + 1) (nothing when that is <= 0: out 0, lse -inf).
    out: optional buffer for the first result, as `sparse_mla_decode_paged`'s.
    """)

__all__ = defined_in(__name__)
