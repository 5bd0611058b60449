"""DSA ops (docs/ops/dsa.md) on the native kernels of csrc/dsa.cpp.

Inputs arrive validated by glm5_hal.ops.dsa; these wrappers allocate outputs (large ones
reused: backends/cpu/buffers.py; an out= buffer, already checked, instead where the caller
gives one) and pass the
tensors (caches and key rows are read in place with their strides; _C copies only what a
kernel cannot read). The native code re-checks every index it dereferences and raises
InvalidInputError itself.
"""
from __future__ import annotations

import torch

from . import cpu
from .buffers import empty
from .native import _C, FLOATS, threads

_I32 = torch.int32


def _split(k):
    """Float keys, or the values and scales of an FP8 pair (docs/ops/dsa.md)."""
    return k if isinstance(k, (tuple, list)) else (k, None)


@cpu.impl("indexer_logits", dtypes=FLOATS, validates_values=True)
def indexer_logits(q, k, weights, k_start, k_end):
    k, k_scale = _split(k)
    out = empty((q.shape[0], k.shape[0]), torch.float32)
    _C.indexer_logits(out, q, k, k_scale, weights, k_start, k_end, threads())
    return out


@cpu.impl("indexer_topk", dtypes=FLOATS, validates_values=True)
def indexer_topk(q, k, weights, k_start, k_end, topk):
    k, k_scale = _split(k)
    out = empty((q.shape[0], topk), _I32)
    _C.indexer_topk(out, q, k, k_scale, weights, k_start, k_end, threads())
    return out


@cpu.impl("indexer_topk_paged", dtypes=FLOATS, validates_values=True)
def indexer_topk_paged(q, k_cache, weights, block_table, context_lens, topk, *, out=None):
    k_cache, k_cache_scale = _split(k_cache)
    if out is None:
        out = empty((q.shape[0], q.shape[1], topk), _I32)
    _C.indexer_topk_paged(out, q, k_cache, k_cache_scale, weights, block_table, context_lens, threads())
    return out


@cpu.impl("sparse_mla_attention", dtypes=FLOATS)
def sparse_mla_attention(q, kv, indices, sm_scale, d_v=512, *, out=None):
    tokens, heads, _ = q.shape
    if out is None:
        out = empty((tokens, heads, d_v), q.dtype)
    lse = torch.empty((tokens, heads), dtype=torch.float32)
    _C.sparse_mla_attention(out, lse, q, kv, indices, float(sm_scale), threads())
    return out, lse


@cpu.impl("sparse_mla_decode_paged", dtypes=FLOATS, validates_values=True)
def sparse_mla_decode_paged(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v=512, *, out=None):
    batch, queries, heads, _ = q.shape
    if out is None:
        out = empty((batch, queries, heads, d_v), q.dtype)
    lse = torch.empty((batch, queries, heads), dtype=torch.float32)
    _C.sparse_mla_decode_paged(out, lse, q, kv_cache, block_table, context_lens, indices, float(sm_scale), threads())
    return out, lse


@cpu.impl("dense_mla_decode_paged", dtypes=FLOATS, validates_values=True)
def dense_mla_decode_paged(q, kv_cache, block_table, context_lens, sm_scale, d_v=512, *, out=None):
    batch, queries, heads, _ = q.shape
    if out is None:
        out = empty((batch, queries, heads, d_v), q.dtype)
    lse = torch.empty((batch, queries, heads), dtype=torch.float32)
    _C.dense_mla_decode_paged(out, lse, q, kv_cache, block_table, context_lens, float(sm_scale), threads())
    return out, lse
