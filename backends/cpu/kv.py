"""The paged KV cache ops on the cpu backend (OPS.md section 6), native (csrc/kv.cpp).
Slot mappings, block tables and lengths were validated by glm5_hal.ops; the kernels check
them again before writing anything (they are callable on their own)."""
from __future__ import annotations

import torch

from glm5_hal.ops.kv import CACHE_DTYPES

from . import cpu
from .native import _C, DTYPE_CODE, FLOATS, threads

_UE8M0 = "ue8m0"


# validates_values: the kernels check slots (range, repeats), lengths and block ids themselves,
# before writing anything (csrc/kv.cpp).
@cpu.impl("kv_cache_write", dtypes=CACHE_DTYPES, validates_values=True)
def kv_cache_write(cache, values, slot_mapping):
    dim = values.shape[1]
    if dim > 1 and values.stride(1) != 1:
        values = values.contiguous()
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    es = cache.element_size()
    _C.kv_cache_write(cache.data_ptr(), cache.shape[0] * cache.shape[1], dim * es, values.data_ptr(),
                      values.stride(0) * es, values.shape[0], slot_mapping.data_ptr(),
                      DTYPE_CODE[slot_mapping.dtype], threads())


@cpu.impl("indexer_k_cache_write", dtypes=FLOATS, validates_values=True)
def indexer_k_cache_write(k, k_cache, k_scale, slot_mapping, scale_fmt=None):
    if k.shape[1] > 1 and k.stride(1) != 1:
        k = k.contiguous()
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    _C.indexer_k_cache_write(k.data_ptr(), k.shape[0], k.shape[1], k.stride(0), DTYPE_CODE[k.dtype],
                             k_cache.data_ptr(), k_scale.data_ptr(), k_cache.shape[0] * k_cache.shape[1],
                             slot_mapping.data_ptr(), DTYPE_CODE[slot_mapping.dtype],
                             scale_fmt == _UE8M0, threads())


@cpu.impl("kv_cache_gather", dtypes=CACHE_DTYPES, validates_values=True)
def kv_cache_gather(cache, block_table, context_lens):
    if not cache.is_contiguous():
        cache = cache.contiguous()
    if not context_lens.is_contiguous():
        context_lens = context_lens.contiguous()
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    num_blocks, block_size, dim = cache.shape
    batch, max_blocks = block_table.shape
    rows = _C.kv_cache_gather_rows(context_lens.data_ptr(), batch, max_blocks, block_size)
    out = torch.empty((rows, dim), dtype=cache.dtype)
    es = cache.element_size()
    _C.kv_cache_gather(out.data_ptr(), rows, cache.data_ptr(), num_blocks, block_size, dim * es,
                       block_table.data_ptr(), batch, max_blocks, block_table.stride(0),
                       context_lens.data_ptr(), threads())
    return out
