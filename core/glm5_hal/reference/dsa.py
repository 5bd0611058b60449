"""Reference implementations of the DSA ops (docs/ops/dsa.md): the lightning indexer and
sparse / dense MLA attention in absorbed (MQA) mode.

Plain torch on any device, vectorised over tokens. Computation runs in float32, or in
float64 when the activations are float64 (the conformance suite feeds upcast inputs); the
contract's float32 outputs (indexer logits, lse) are then float64 too, so the judge does not
round its own answer. FP8 keys are dequantised in float32 exactly as the contract writes it
(`k_fp8.float() * k_scale[:, None]`). Paged caches are read through the block table by
gathering whole logical rows; dense decode pads every sequence to the longest context.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import compute_dtype

__all__ = [
    "indexer_logits",
    "indexer_topk",
    "indexer_topk_paged",
    "sparse_mla_attention",
    "sparse_mla_decode_paged",
    "dense_mla_decode_paged",
]

_NEG_INF = float("-inf")

def _score_dtype(ct: torch.dtype) -> torch.dtype:
    """Dtype of the contract's float32 outputs (logits, lse) for compute dtype `ct`."""
    return torch.float64 if ct == torch.float64 else torch.float32


def _dequant_keys(k, ct: torch.dtype) -> Tensor:
    """`k` as rows of dtype `ct`: a float tensor, or an (fp8, scale) pair scaled per row."""
    if isinstance(k, (tuple, list)):
        k_fp8, k_scale = k
        return (k_fp8.float() * k_scale.float().unsqueeze(-1)).to(ct)
    return k.to(ct)


def _weighted_relu_logits(q: Tensor, keys: Tensor, weights: Tensor, ct: torch.dtype) -> Tensor:
    """sum_h weights[..., h] * relu(q[..., h, :] . keys[..., s, :]) -> [..., S].

    q [..., Hi, D], keys [..., S, D] (leading dims broadcast), weights [..., Hi]."""
    scores = torch.matmul(q.to(ct), keys.transpose(-1, -2))           # [..., Hi, S]
    return torch.matmul(weights.to(ct).unsqueeze(-2), scores.relu()).squeeze(-2)


def _topk_left_packed(logits: Tensor, count: Tensor, topk: int) -> Tensor:
    """Positions of the `topk` largest entries of each row of `logits` [..., S], of which
    the first count[...] (by value) are the row's in-range keys; -1 beyond that count.

    Out-of-range entries are -inf and every in-range logit is finite, so a descending sort
    puts exactly the in-range keys first; ranking by count (not by `!= -inf`) keeps the
    number of valid entries exact."""
    size = logits.shape[-1]
    if size < topk:
        logits = F.pad(logits, (0, topk - size), value=_NEG_INF)
    _, positions = torch.topk(logits, topk, dim=-1, largest=True, sorted=True)
    rank = torch.arange(topk, device=logits.device)
    keep = rank < count.unsqueeze(-1).clamp(max=topk)
    return torch.where(keep, positions, -1).to(torch.int32)


def indexer_logits(q: Tensor, k, weights: Tensor, k_start: Tensor, k_end: Tensor) -> Tensor:
    """logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s]) for k_start[t] <= s < k_end[t],
    -inf elsewhere. `k` is [S, D] or an FP8 pair (k_fp8 [S, D], k_scale [S])."""
    ct = compute_dtype(q.dtype)
    keys = _dequant_keys(k, ct)                                         # [S, D]
    logits = _weighted_relu_logits(q, keys, weights, ct)                # [T, S]
    positions = torch.arange(keys.shape[0], device=q.device)
    in_range = (positions >= k_start.unsqueeze(-1)) & (positions < k_end.unsqueeze(-1))
    return logits.masked_fill(~in_range, _NEG_INF).to(_score_dtype(ct))


def indexer_topk(q: Tensor, k, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    """int32 [T, topk]: key positions of the `topk` largest `indexer_logits` per row,
    left-packed, -1 padded when fewer than `topk` keys are in range."""
    logits = indexer_logits(q, k, weights, k_start, k_end)
    count = (k_end.long() - k_start.long()).clamp(min=0)
    return _topk_left_packed(logits, count, topk)


def _logical_slots(block_table: Tensor, positions: Tensor, valid: Tensor, block_size: int) -> Tensor:
    """Flat physical slots of logical `positions` [B, ...] (int64); 0 where not `valid`, so
    padding entries of the block table (e.g. -1) are never dereferenced."""
    if block_table.shape[1] == 0:  # zero capacity: every position is invalid, gather a dummy
        block_table = block_table.new_zeros((block_table.shape[0], 1))
    safe = torch.where(valid, positions.long(), 0)
    blocks = block_table.long().gather(1, (safe // block_size).flatten(1)).reshape(safe.shape)
    return torch.where(valid, blocks * block_size + safe % block_size, 0)


def _gather_rows(cache_rows: Tensor, slots: Tensor) -> Tensor:
    """cache_rows[slots] with an all-masked gather from an empty cache allowed."""
    if cache_rows.shape[0] == 0:
        cache_rows = cache_rows.new_zeros((1,) + tuple(cache_rows.shape[1:]))
    return cache_rows[slots]


def _gather_slots(cache: Tensor, slots: Tensor) -> Tensor:
    """The rows of flat `slots` of a paged cache [num_blocks, block_size, ...], read in place
    (block s // block_size, offset s % block_size): a block-strided view is never copied."""
    if cache.shape[0] * cache.shape[1] == 0:
        return _gather_rows(cache.reshape((0,) + tuple(cache.shape[2:])), slots)
    block_size = cache.shape[1]
    return cache[slots // block_size, slots % block_size]


def _max_context(context_lens: Tensor) -> int:
    return int(context_lens.max().item()) if context_lens.numel() else 0


def _decode_visible(context_lens: Tensor, num_queries: int) -> Tensor:
    """[B, N]: query i of N sees logical positions [0, context_lens[b] - N + i + 1), clipped at 0."""
    i = torch.arange(num_queries, device=context_lens.device)
    return (context_lens.long().unsqueeze(-1) - num_queries + i + 1).clamp(min=0)


def indexer_topk_paged(q: Tensor, k_cache, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    """int32 [B, N, topk]: logical key positions of the `topk` largest indexer logits of
    query i of sequence b over [0, context_lens[b] - N + i + 1), left-packed, -1 padded."""
    ct = compute_dtype(q.dtype)
    fp8 = isinstance(k_cache, (tuple, list))
    values = k_cache[0] if fp8 else k_cache
    block_size = values.shape[1]
    length = _max_context(context_lens)
    positions = torch.arange(length, device=q.device).expand(block_table.shape[0], length)
    stored = positions < context_lens.long().unsqueeze(-1)             # [B, L]
    slots = _logical_slots(block_table, positions, stored, block_size)
    rows = _gather_slots(values, slots)                                 # [B, L, D]
    if fp8:
        rows = (rows, _gather_slots(k_cache[1], slots))
    keys = _dequant_keys(rows, ct)
    logits = _weighted_relu_logits(q, keys.unsqueeze(1), weights, ct)   # [B, N, L]
    visible = _decode_visible(context_lens, q.shape[1])                 # [B, N]
    in_range = torch.arange(length, device=q.device) < visible.unsqueeze(-1)
    logits = logits.masked_fill(~in_range, _NEG_INF)
    return _topk_left_packed(logits, visible, topk)


def _attend(q: Tensor, rows: Tensor, valid: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """Softmax attention of q [..., H, Dqk] over rows [..., K, Dqk] where valid [..., K]
    (leading dims broadcast): z = sm_scale * q . row, out = softmax(z) @ row[:, :d_v],
    lse = logsumexp(z); a query with no valid row gets out 0 and lse -inf."""
    ct = compute_dtype(q.dtype)
    rows = rows.to(ct)
    scores = torch.matmul(q.to(ct), rows.transpose(-1, -2)) * sm_scale  # [..., H, K]
    scores = scores.masked_fill(~valid.unsqueeze(-2), _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)                               # [..., H]
    # exp(-inf - 0) = 0 turns an all-invalid row into zero weights instead of NaN
    shift = lse.masked_fill(lse == _NEG_INF, 0.0)
    probs = torch.exp(scores - shift.unsqueeze(-1))
    out = torch.matmul(probs, rows[..., :d_v])
    return out.to(q.dtype), lse.to(_score_dtype(ct))


def sparse_mla_attention(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                         d_v: int = 512) -> tuple[Tensor, Tensor]:
    """(out [T, H, d_v] like q, lse [T, H]): attention of q[t] over rows kv[indices[t, j]]
    for the valid entries (0 <= idx < S); others are ignored, duplicates count each time."""
    valid = (indices >= 0) & (indices < kv.shape[0])                   # [T, K]
    rows = _gather_rows(kv, torch.where(valid, indices.long(), 0))     # [T, K, Dqk]
    return _attend(q, rows, valid, sm_scale, d_v)


def sparse_mla_decode_paged(q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                            indices: Tensor, sm_scale: float, d_v: int = 512) -> tuple[Tensor, Tensor]:
    """(out [B, N, H, d_v], lse [B, N, H]): sparse attention over logical positions
    `indices[b, i]` of sequence b's paged cache, valid iff 0 <= p < context_lens[b]."""
    block_size = kv_cache.shape[1]
    valid = (indices >= 0) & (indices < context_lens.view(-1, 1, 1))    # [B, N, K]
    slots = _logical_slots(block_table, indices, valid, block_size)
    rows = _gather_slots(kv_cache, slots)                               # [B, N, K, Dqk]
    return _attend(q, rows, valid, sm_scale, d_v)


def dense_mla_decode_paged(q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                           sm_scale: float, d_v: int = 512) -> tuple[Tensor, Tensor]:
    """(out [B, N, H, d_v], lse [B, N, H]): query i of N attends logical positions
    [0, context_lens[b] - N + i + 1) of sequence b's paged cache."""
    block_size = kv_cache.shape[1]
    length = _max_context(context_lens)
    positions = torch.arange(length, device=q.device).expand(block_table.shape[0], length)
    stored = positions < context_lens.long().unsqueeze(-1)             # [B, L]
    slots = _logical_slots(block_table, positions, stored, block_size)
    rows = _gather_slots(kv_cache, slots).unsqueeze(1)                  # [B, 1, L, Dqk]
    visible = _decode_visible(context_lens, q.shape[1])                 # [B, N]
    valid = torch.arange(length, device=q.device) < visible.unsqueeze(-1)
    return _attend(q, rows, valid, sm_scale, d_v)
