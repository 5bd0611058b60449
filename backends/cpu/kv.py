"""The paged KV cache ops on the cpu backend (docs/ops/kv.md), native (csrc/kv.cpp).
Slot mappings, block tables and lengths were validated by glm5_hal.ops; the kernels check
them again before writing anything (they are callable on their own)."""
from __future__ import annotations

import torch

from glm5_hal.ops.kv import CACHE_DTYPES

from . import cpu
from .native import _C, FLOATS, threads

_UE8M0 = "ue8m0"


# validates_values: the kernels check slots (range, repeats), lengths and block ids themselves,
# before writing anything (csrc/kv.cpp).
@cpu.impl("kv_cache_write", dtypes=CACHE_DTYPES, validates_values=True)
def kv_cache_write(cache, values, slot_mapping):
    _C.kv_cache_write(cache, values, slot_mapping, threads())


@cpu.impl("indexer_k_cache_write", dtypes=FLOATS, validates_values=True)
def indexer_k_cache_write(k, k_cache, k_scale, slot_mapping, scale_fmt=None):
    _C.indexer_k_cache_write(k, k_cache, k_scale, slot_mapping, scale_fmt == _UE8M0, threads())


@cpu.impl("kv_cache_gather", dtypes=CACHE_DTYPES, validates_values=True)
def kv_cache_gather(cache, block_table, context_lens):
    return _C.kv_cache_gather(None, cache, block_table, context_lens, threads())
