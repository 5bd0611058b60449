"""Reference implementations of the paged KV cache ops (docs/ops/kv.md).

Plain torch on any device. Slot mappings and block tables are trusted here: the public ops
validate them (range, duplicates) before anything is written.
"""
from __future__ import annotations

import torch

from .quant import fp8_block_quant

__all__ = ["kv_cache_write", "indexer_k_cache_write", "kv_cache_gather"]


def _block_and_offset(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot s of a paged cache (contiguous or a block-strided view) is cache[s // bs, s % bs]."""
    block_size = cache.shape[1]
    return slots // block_size, slots % block_size


def kv_cache_write(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    cache.index_put_(_block_and_offset(cache, slots), values[written])


def indexer_k_cache_write(k: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor,
                          slot_mapping: torch.Tensor, scale_fmt: str | None = None) -> None:
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    q, scale = fp8_block_quant(k[written], block=k.shape[-1], scale_fmt=scale_fmt)
    # index_put_ rather than index_copy_: the latter has no float8 kernel on the CPU.
    k_cache.index_put_(_block_and_offset(k_cache, slots), q)
    # to k_scale's dtype: the conformance reference runs with every float tensor upcast to float64
    k_scale.index_put_(_block_and_offset(k_scale, slots), scale.squeeze(-1).to(k_scale.dtype))


def kv_cache_gather(cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor
                    ) -> torch.Tensor:
    block_size = cache.shape[1]
    lens = context_lens.long()
    total = int(lens.sum())
    device = cache.device
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens,
                                  output_size=total)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=device) - starts[seq]
    blocks = block_table[seq, pos // block_size].long()
    return cache[blocks, pos % block_size]
