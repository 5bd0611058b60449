"""Vendor adapter helpers of the paged KV cache ops (docs/ops/kv.md): the limits of kernels
that take int32 slots or index a cache flat, and kv_cache_write through vLLM's
reshape_and_cache schema."""
from __future__ import annotations

from typing import Callable

import torch

from ..vendor_backend import INT32_MAX


def int32_slots_declined(cache: torch.Tensor, kernel: str) -> str | None:
    """The reason to decline a paged cache [blocks, block_size, ...] too large for a kernel
    that takes int32 slots."""
    if cache.shape[0] * cache.shape[1] > INT32_MAX:
        return f"{kernel} takes int32 slots; this cache has more than 2^31-1"
    return None


def paged_view_declined(kernel: str, *caches: torch.Tensor) -> str | None:
    """The reason to decline a cache write whose kernel indexes the cache flat, when a cache is
    a block-strided paged view (vLLM's page layout) rather than a contiguous tensor. It reads
    strides, which the call key does not hold (only whether a cache is paged): a predicate
    calling it is a per-call `supports`."""
    if all(c.is_contiguous() for c in caches):
        return None
    return (f"{kernel} indexes a contiguous cache; this one is a block-strided paged view "
            "(copying it would cost a whole-cache copy per call)")


def write_key_rows(reshape_and_cache: Callable, cache: torch.Tensor, values: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache_write through a vLLM-style `reshape_and_cache(key [T, heads, D], value,
    key_cache [blocks, heads, block_size, D], value_cache, slots int32)`: the MLA latent row
    is the whole cache row, so the contract's cache is the key cache of one head, no values."""
    tokens, dim = values.shape
    if tokens == 0:
        return
    reshape_and_cache(values.reshape(tokens, 1, dim).contiguous(), None,
                      cache.view(cache.shape[0], 1, cache.shape[1], dim), None,
                      slot_mapping.to(torch.int32).contiguous())
