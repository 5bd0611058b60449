"""Paged KV cache bookkeeping (docs/ops/kv.md): a reference-counted block pool and
per-sequence block tables that produce the slot mappings and block tables the kv ops take.

    import glm5_hal as hal
    cache = hal.kv.PagedKVCache(num_blocks=64, block_size=16, dim=576)
    slots = cache.append("req-0", 5)
    hal.ops.kv_cache_write(cache.tensor, values, slots)
"""
from .allocator import BlockAllocator, OutOfBlocksError
from .cache import PAD_BLOCK, PagedKVCache

__all__ = ["BlockAllocator", "OutOfBlocksError", "PagedKVCache", "PAD_BLOCK"]
