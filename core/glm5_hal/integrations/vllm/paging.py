"""vLLM's per-step batch as glm5_hal's paged ops take it, built once per step and shared by the
indexer and the sparse-MLA attention (one KV-cache group: one block table, one slot mapping).

vLLM packs the step's tokens request by request, decodes first (the builder asks vLLM to
reorder the batch). glm5_hal's paged ops take `B` sequences of `N` query tokens each, the
last `N` positions of each sequence's context (`indexer_topk_paged`,
`sparse_mla_decode_paged`). So the batch is cut into runs of consecutive requests with equal
query lengths: the decodes form one run (`N = 1`, or the MTP draft length), each prefill
chunk (a whole prompt, its uncached part after a prefix-cache hit, or one chunk of a chunked
prefill) is a run of `N` = its length. A query token's visible range is then exactly
vLLM's causal range `[0, seq_len - N + i + 1)`, and the caches are read in place.
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["Run", "StepBatch", "runs_of", "build_step_batch", "indexer_page_views"]

FP8 = torch.float8_e4m3fn
SCALE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Run:
    """Requests [first, first + count) of the step, `length` query tokens each: tokens
    [start, start + count * length) of the step, in request order."""
    first: int
    count: int
    length: int
    start: int

    @property
    def tokens(self) -> int:
        return self.count * self.length


def runs_of(query_start_loc: list[int]) -> tuple[Run, ...]:
    """Runs of consecutive requests with equal (non-zero) query lengths."""
    runs: list[Run] = []
    for r in range(len(query_start_loc) - 1):
        start, length = query_start_loc[r], query_start_loc[r + 1] - query_start_loc[r]
        if length <= 0:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.length == length and last.first + last.count == r:
            runs[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            runs.append(Run(r, 1, length, start))
    return tuple(runs)


@dataclasses.dataclass
class StepBatch:
    """What the glm5_hal paged ops need of one step (all device tensors are views of vLLM's
    own per-step buffers; nothing of the caches is copied).

    seq_lens: int32 [R], each request's context length including this step's tokens.
    block_table: int32 [R, max_blocks]. slot_mapping: int64 [T], -1 for padding.
    runs: the requests grouped by query length (see the module docstring)."""
    num_actual_tokens: int
    num_reqs: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    runs: tuple[Run, ...]
    # the counts vLLM's MLA layer reads: every token goes through the sparse (MQA) path
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0


def build_step_batch(common, cls: type[StepBatch] = StepBatch) -> StepBatch:
    """A StepBatch (or subclass `cls`) from vLLM's CommonAttentionMetadata. Reads the host copy
    of the query offsets only (`query_start_loc_cpu`): no device sync."""
    starts = common.query_start_loc_cpu[: common.num_reqs + 1].tolist()
    tokens = common.num_actual_tokens
    return cls(
        num_actual_tokens=tokens, num_reqs=common.num_reqs,
        seq_lens=common.seq_lens[: common.num_reqs].to(torch.int32),
        block_table=common.block_table_tensor[: common.num_reqs].to(torch.int32),
        slot_mapping=common.slot_mapping[:tokens],
        runs=runs_of(starts),
        num_decodes=common.num_reqs, num_prefills=0, num_decode_tokens=tokens, num_prefill_tokens=0)


def indexer_page_views(pages: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's indexer cache `[num_blocks, block_size, head_dim + 4]` uint8 (each block: its
    `block_size x head_dim` FP8 keys, then `block_size` float32 scales) as glm5_hal's FP8 key
    pair: (float8_e4m3fn `[num_blocks, block_size, head_dim]`, float32 `[num_blocks, block_size]`),
    both views of the same memory."""
    num_blocks, block_size, row = pages.shape
    if row != head_dim + SCALE_BYTES or pages.dtype != torch.uint8:
        raise ValueError(f"an indexer page of uint8 [num_blocks, block_size, {head_dim + SCALE_BYTES}] "
                         f"expected, got {pages.dtype} {list(pages.shape)}")
    flat = pages.flatten(1)
    keys = flat[:, : block_size * head_dim].view(num_blocks, block_size, head_dim).view(FP8)
    scales = flat[:, block_size * head_dim:].view(torch.float32)
    return keys, scales
