"""DSA ops (OPS.md section 4) on the native kernels of csrc/dsa.cpp.

Inputs arrive validated by glm5_hal.ops.dsa; these wrappers only make layouts kernel-ready
(caches and key rows are passed with their strides and read in place; small dense inputs are
made contiguous), allocate outputs and pass data pointers. The native code re-checks every
index it dereferences and raises InvalidInputError itself.
"""
from __future__ import annotations

import torch

from . import cpu
from .native import _C, DTYPE_CODE, FLOATS, FP8, readable_page_scales, readable_pages, readable_rows, threads


def _keys(k):
    """(values [S, D], dtype code, rows, row stride, scale pointer, scale stride, keep-alive)."""
    if isinstance(k, (tuple, list)):
        values, scale = k
        values, stride = readable_rows(values)
        scale_stride = scale.stride(0) if scale.shape[0] > 1 else 1
        if scale_stride < 1:
            scale, scale_stride = scale.contiguous(), 1
        return values, DTYPE_CODE[FP8], values.shape[0], stride, scale.data_ptr(), scale_stride, scale
    values, stride = readable_rows(k)
    return values, DTYPE_CODE[values.dtype], values.shape[0], stride, 0, 0, None


def _paging(block_table: torch.Tensor, context_lens: torch.Tensor):
    block_table = block_table.contiguous()
    return block_table, block_table.shape[1], context_lens.contiguous()


@cpu.impl("indexer_logits", dtypes=FLOATS, validates_values=True)
def indexer_logits(q, k, weights, k_start, k_end):
    q, weights = q.contiguous(), weights.contiguous()
    k_start, k_end = k_start.contiguous(), k_end.contiguous()
    values, kcode, rows, stride, scale_ptr, scale_stride, _scale = _keys(k)
    tokens, heads, dim = q.shape
    out = torch.empty((tokens, rows), dtype=torch.float32)
    _C.indexer_logits(out.data_ptr(), rows, q.data_ptr(), DTYPE_CODE[q.dtype], tokens, heads, dim,
                      values.data_ptr(), kcode, rows, stride, scale_ptr, scale_stride,
                      weights.data_ptr(), k_start.data_ptr(), k_end.data_ptr(), threads())
    return out


@cpu.impl("indexer_topk", dtypes=FLOATS, validates_values=True)
def indexer_topk(q, k, weights, k_start, k_end, topk):
    q, weights = q.contiguous(), weights.contiguous()
    k_start, k_end = k_start.contiguous(), k_end.contiguous()
    values, kcode, rows, stride, scale_ptr, scale_stride, _scale = _keys(k)
    tokens, heads, dim = q.shape
    out = torch.empty((tokens, topk), dtype=torch.int32)
    _C.indexer_topk(out.data_ptr(), topk, q.data_ptr(), DTYPE_CODE[q.dtype], tokens, heads, dim,
                    values.data_ptr(), kcode, rows, stride, scale_ptr, scale_stride,
                    weights.data_ptr(), k_start.data_ptr(), k_end.data_ptr(), threads())
    return out


@cpu.impl("indexer_topk_paged", dtypes=FLOATS, validates_values=True)
def indexer_topk_paged(q, k_cache, weights, block_table, context_lens, topk):
    q, weights = q.contiguous(), weights.contiguous()
    if isinstance(k_cache, (tuple, list)):
        cache, scale = k_cache
        cache, block, row = readable_pages(cache)
        scale, scale_block, scale_row = readable_page_scales(scale)
        scale_ptr = scale.data_ptr()
    else:
        cache, block, row = readable_pages(k_cache)
        scale, scale_ptr, scale_block, scale_row = None, 0, 0, 0
    block_table, max_blocks, context_lens = _paging(block_table, context_lens)
    batch, queries, heads, dim = q.shape
    out = torch.empty((batch, queries, topk), dtype=torch.int32)
    _C.indexer_topk_paged(out.data_ptr(), topk, q.data_ptr(), DTYPE_CODE[q.dtype], batch, queries, heads, dim,
                          cache.data_ptr(), DTYPE_CODE[cache.dtype], cache.shape[0], cache.shape[1], block, row,
                          scale_ptr, scale_block, scale_row, weights.data_ptr(), block_table.data_ptr(),
                          max_blocks, max_blocks, context_lens.data_ptr(), threads())
    return out


@cpu.impl("sparse_mla_attention", dtypes=FLOATS)
def sparse_mla_attention(q, kv, indices, sm_scale, d_v=512):
    q, indices = q.contiguous(), indices.contiguous()
    kv, stride = readable_rows(kv)
    tokens, heads, dqk = q.shape
    out = torch.empty((tokens, heads, d_v), dtype=q.dtype)
    lse = torch.empty((tokens, heads), dtype=torch.float32)
    _C.sparse_mla_attention(out.data_ptr(), lse.data_ptr(), q.data_ptr(), DTYPE_CODE[q.dtype], tokens, heads, dqk,
                            kv.data_ptr(), kv.shape[0], stride, indices.data_ptr(), indices.shape[1],
                            float(sm_scale), d_v, threads())
    return out, lse


@cpu.impl("sparse_mla_decode_paged", dtypes=FLOATS, validates_values=True)
def sparse_mla_decode_paged(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v=512):
    q, indices = q.contiguous(), indices.contiguous()
    cache, block, row = readable_pages(kv_cache)
    block_table, max_blocks, context_lens = _paging(block_table, context_lens)
    batch, queries, heads, dqk = q.shape
    out = torch.empty((batch, queries, heads, d_v), dtype=q.dtype)
    lse = torch.empty((batch, queries, heads), dtype=torch.float32)
    _C.sparse_mla_decode_paged(out.data_ptr(), lse.data_ptr(), q.data_ptr(), DTYPE_CODE[q.dtype], batch, queries,
                               heads, dqk, cache.data_ptr(), DTYPE_CODE[cache.dtype], cache.shape[0],
                               cache.shape[1], block, row, block_table.data_ptr(), max_blocks, max_blocks,
                               context_lens.data_ptr(), indices.data_ptr(), indices.shape[2], float(sm_scale),
                               d_v, threads())
    return out, lse


@cpu.impl("dense_mla_decode_paged", dtypes=FLOATS, validates_values=True)
def dense_mla_decode_paged(q, kv_cache, block_table, context_lens, sm_scale, d_v=512):
    q = q.contiguous()
    cache, block, row = readable_pages(kv_cache)
    block_table, max_blocks, context_lens = _paging(block_table, context_lens)
    batch, queries, heads, dqk = q.shape
    out = torch.empty((batch, queries, heads, d_v), dtype=q.dtype)
    lse = torch.empty((batch, queries, heads), dtype=torch.float32)
    _C.dense_mla_decode_paged(out.data_ptr(), lse.data_ptr(), q.data_ptr(), DTYPE_CODE[q.dtype], batch, queries,
                              heads, dqk, cache.data_ptr(), DTYPE_CODE[cache.dtype], cache.shape[0],
                              cache.shape[1], block, row, block_table.data_ptr(), max_blocks, max_blocks,
                              context_lens.data_ptr(), float(sm_scale), d_v, threads())
    return out, lse
