"""The indexer ops without the indexer kernel: float32 logits on torch, the top-k of each row
by a vendor's port of vLLM's `top_k_per_row_prefill` (csrc/sampler.cu @00e831b2; lightop on a
DCU, FlagGems on Iluvatar CoreX). The dcu and iluvatar adapters route here when their
CUDA-dialect kernel is not built.

`kernel` is that function, with vLLM's schema: `kernel(logits [rows, S] float32, row_starts,
row_ends (int32 [rows]), indices (int32 [rows, topk], written), rows, stride0, stride1, topk)`,
writing each row's top-k positions relative to its start. What the ports write past a row
shorter than topk differs (vLLM -1, FlagGems 0, lightop closed), so the results are kept only
where the slot position says they are valid (`sanitise_topk`). Nothing reads device data on
the host; logits are computed in row chunks within WORKSPACE_BUDGET_BYTES.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from . import WORKSPACE_BUDGET_BYTES

_I32, _I64 = torch.int32, torch.int64


def _dequantized(k: Any) -> Tensor:
    """float32 keys from float keys or FP8 keys with their scales, (codes, scale)."""
    if isinstance(k, (tuple, list)):
        return k[0].float() * k[1].float().unsqueeze(-1)
    return k.float()


def sanitise_topk(indices: Tensor, lengths: Tensor) -> Tensor:
    """Keeps slot j of row r only if j < lengths[r] and 0 <= indices[r, j] < lengths[r]; -1
    elsewhere: the slot position decides, not what a port of the kernel leaves in the tail."""
    slot = torch.arange(indices.shape[-1], device=indices.device)
    length = lengths.to(_I64).unsqueeze(-1)
    keep = (slot < length) & (indices >= 0) & (indices < length)
    return torch.where(keep, indices, -1).to(_I32)


def top_k_per_row(kernel: Callable, logits: Tensor, starts: Tensor, ends: Tensor, topk: int) -> Tensor:
    """Top-k positions (relative to each row's start) of logits [rows, S] over [starts, ends)."""
    rows = logits.shape[0]
    indices = torch.full((rows, topk), -1, dtype=_I32, device=logits.device)
    logits = logits.contiguous()
    starts, ends = starts.to(_I32).contiguous(), ends.to(_I32).contiguous()
    kernel(logits, starts, ends, indices, rows, logits.stride(0), logits.stride(1), topk)
    return sanitise_topk(indices, (ends - starts).clamp_(min=0))


def _row_chunk(floats_per_row: int) -> int:
    return max(1, WORKSPACE_BUDGET_BYTES // (4 * max(floats_per_row, 1)))


def indexer_topk(kernel: Callable, q: Tensor, k: Any, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    """indexer_topk: logits [t, S] = sum_h w[t, h] * relu(q[t, h] . k[s]) in float32 on torch,
    then `kernel` over each token's [k_start, k_end)."""
    tokens, heads, _ = q.shape
    out = torch.full((tokens, topk), -1, dtype=_I32, device=q.device)
    keys = _dequantized(k)
    step = _row_chunk(heads * keys.shape[0])
    for first in range(0, tokens, step):
        last = min(tokens, first + step)
        logits = torch.einsum("thd,sd->ths", q[first:last].float(), keys).relu_()
        logits = (logits * weights[first:last].float().unsqueeze(-1)).sum(1)
        start = k_start[first:last]
        relative = top_k_per_row(kernel, logits, start, k_end[first:last], topk)
        out[first:last] = torch.where(relative >= 0, relative + start.unsqueeze(-1), -1)
    return out


def indexer_topk_paged(kernel: Callable, q: Tensor, k_cache: Any, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    """indexer_topk_paged: each sequence's logical keys gathered through its block-table row,
    logits as in indexer_topk, and query n of a sequence of length L ranging over [0, L - N + 1 + n)."""
    batch, queries, heads, dim = q.shape
    out = torch.full((batch, queries, topk), -1, dtype=_I32, device=q.device)
    keys = _dequantized(k_cache)
    block_size = keys.shape[1]
    # every sequence's keys fit in its block-table row: a bound read from the shapes, not the
    # data (reading context_lens.max() would synchronise the device)
    span = block_table.shape[1] * block_size
    if out.numel() == 0 or span == 0:
        return out
    flat = keys.reshape(-1, dim)
    positions = torch.arange(span, device=q.device)
    step = _row_chunk(queries * heads * span + span * dim)
    for first in range(0, batch, step):
        last = min(batch, first + step)
        lens = context_lens[first:last].long()
        # the logical keys of each sequence, [b, span, D] (rows past its length are unused)
        table = block_table[first:last].long()
        in_use = positions[None, :] < lens[:, None]
        blocks = table.gather(1, (positions // block_size).clamp(max=table.shape[1] - 1)[None, :]
                              .expand(last - first, -1))
        rows = torch.where(in_use, blocks * block_size + positions % block_size, 0)
        logits = torch.einsum("bnhd,bsd->bnhs", q[first:last].float(), flat[rows]).relu_()
        logits = (logits * weights[first:last].float().unsqueeze(-1)).sum(2)  # [b, N, span]
        ends = (lens[:, None] - queries + 1 + torch.arange(queries, device=q.device)[None, :]).clamp(min=0)
        found = top_k_per_row(kernel, logits.reshape(-1, span), torch.zeros_like(ends).reshape(-1),
                              ends.reshape(-1), topk)
        out[first:last] = found.view(last - first, queries, topk)
    return out
