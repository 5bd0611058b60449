"""Adapters from glm5_hal ops to the CUDA-dialect kernels, shared by the backends that build
them (musa: mcc, dcu: hipcc). Each takes the backend first; the backend has `kernels` (a
GpuKernelLibrary) and `stream(device) -> int` (its framework's current raw stream).

The `Adapter` records below go into a backend's ADAPTERS table as they are (the kernel-only
ops); the sparse MLA helpers are building blocks a backend combines with its vendor library
(the musa backend tries MUSA FlashMLA first). Every adapter's predicate declines with the library's
reason ("MUSA kernel not built (...)") when the kernels are absent, so dispatch moves on.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from glm5_hal.vendor_backend import Adapter, Verdict, first_reason
from glm5_hal.vendor_ops.dsa import sparse_mla_decode_declined

from . import INDEXER_MAX_HEADS, INDEXER_MAX_QROW, MLA_MAX_DQK, MLA_MAX_DV

_I32 = torch.int32
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

#: what the kernels accept, as reported in a backend's capabilities().limits
KERNEL_LIMITS = {
    "kernels: sparse MLA": f"Dqk <= {MLA_MAX_DQK}, d_v <= {MLA_MAX_DV}; f32/f16/bf16",
    "kernels: indexer top-k": f"heads <= {INDEXER_MAX_HEADS}, heads * D <= {INDEXER_MAX_QROW}; float or FP8 keys",
    "kernels: kv_cache_write": "contiguous cache, any dtype (rows copied as bytes)",
    "kernels: moe_permute / moe_unpermute": "T * k < 2^31; unpermute accumulates in float32 with atomics",
}


def split_key(k: Any) -> tuple[Tensor, Tensor | None]:
    return (k[0], k[1]) if isinstance(k, (tuple, list)) else (k, None)


# -- torch._grouped_mm (the MUSA and ROCm/DTK builds of torch both offer it) ---------------------
def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _aligned(t: Tensor) -> Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


def grouped_mm(torch_ns: Any, x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """grouped_gemm through torch._grouped_mm(a [M, K], b [E, K, N], offs, None, out_dtype)."""
    rows, inner = x.shape
    cols = w.shape[1]
    if rows == 0 or cols == 0 or inner == 0:
        return x.new_zeros((rows, cols))
    # _grouped_mm wants strides that are multiples of 16 bytes and 16-byte aligned data;
    # zero-padding K changes no product
    padded = _round_up(inner, 16 // x.element_size())
    a = _aligned(torch.nn.functional.pad(x, (0, padded - inner)) if padded != inner else x.contiguous())
    wp = _aligned(torch.nn.functional.pad(w, (0, padded - inner)) if padded != inner else w.contiguous())
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=_I32)
    # b = w^T per expert as a transposed view [E, K, N] (strides N*K, 1, K), the layout the
    # vendors' grouped GEMM tests use
    return torch_ns._grouped_mm(a, wp.transpose(1, 2), offsets, None, x.dtype)


# -- sparse MLA building blocks ------------------------------------------------------------------
def paged_to_physical(indices: Tensor, block_table: Tensor, context_lens: Tensor, block_size: int,
                      num_blocks: int | None = None) -> tuple[Tensor, Tensor]:
    """Logical positions [B, N, topk] -> (cache rows int32 with -1 where invalid, valid mask).
    A position is valid iff 0 <= p < context_lens[b] (the contract). glm5_hal.ops checks the
    block ids in use on CPU tensors only (elsewhere that would read the device back); given
    `num_blocks`, a position whose block id is outside [0, num_blocks) is made invalid too,
    on the device, so a kernel that trusts its indices never reads past the cache."""
    p = indices.long()
    valid = (p >= 0) & (p < context_lens.long().view(-1, 1, 1))
    if block_table.shape[1] == 0:  # context_lens are all 0 then
        return torch.full_like(indices, -1, dtype=_I32), valid
    block = torch.where(valid, p // block_size, 0).clamp_(max=block_table.shape[1] - 1)
    ids = block_table.long().gather(1, block.view(block.shape[0], -1)).view_as(p)
    if num_blocks is not None:
        valid &= (ids >= 0) & (ids < num_blocks)
    rows = ids * block_size + p % block_size
    return torch.where(valid, rows, -1).to(_I32), valid


def no_valid_rows(q: Tensor, d_v: int, lead: tuple) -> tuple[Tensor, Tensor]:
    """The contract's result when no index is valid: out 0, lse -inf."""
    heads = q.shape[-2]
    return (q.new_zeros((*lead, heads, d_v)),
            torch.full((*lead, heads), float("-inf"), dtype=torch.float32, device=q.device))


def sparse_attention_by_rows(flash: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]],
                              q: Tensor, kv: Tensor, indices: Tensor, d_v: int) -> tuple[Tensor, Tensor]:
    """sparse_mla_attention through a FlashMLA-style `flash(q [R, H, Dqk], kv_rows [S, Dqk], rows
    [R, topk] int32 with -1 invalid, valid mask)` (the cuda and musa backends' FlashMLA)."""
    if q.shape[0] == 0 or kv.shape[0] == 0:
        return no_valid_rows(q, d_v, (q.shape[0],))
    valid = (indices >= 0) & (indices < kv.shape[0])
    return flash(q, kv, torch.where(valid, indices, -1).to(_I32), valid)


def sparse_decode_by_rows(flash: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]],
                          q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor, indices: Tensor,
                          d_v: int) -> tuple[Tensor, Tensor]:
    """sparse_mla_decode_paged through the same `flash`: logical positions become cache rows on
    the device, block ids outside the cache made invalid (the kernel trusts its rows)."""
    batch, queries, heads, dqk = q.shape
    if q.numel() == 0 or kv_cache.shape[0] == 0:
        return no_valid_rows(q, d_v, (batch, queries))
    rows, valid = paged_to_physical(indices, block_table, context_lens, kv_cache.shape[1],
                                    num_blocks=kv_cache.shape[0])
    out, lse = flash(q.reshape(batch * queries, heads, dqk), kv_cache.reshape(-1, dqk),
                     rows.reshape(batch * queries, -1), valid.reshape(batch * queries, -1))
    return out.reshape(batch, queries, heads, -1), lse.reshape(batch, queries, heads)


def sparse_mla_attention_declined(backend: Any, q: Tensor, kv: Tensor, d_v: int) -> str | None:
    return sparse_mla_decode_declined(backend, q.shape[-2], q.shape[-1], d_v, kv.shape[0])


def sparse_mla_attention_supported(backend: Any, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                                   d_v: int) -> Verdict:
    return sparse_mla_attention_declined(backend, q, kv, d_v) or True


def sparse_mla_attention(backend: Any, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                         d_v: int) -> tuple[Tensor, Tensor]:
    """sparse_mla_attention on the decode kernel, as one sequence whose cache is a single
    block of S rows."""
    tokens = q.shape[0]
    if tokens == 0 or kv.shape[0] == 0:
        return no_valid_rows(q, d_v, (tokens,))
    one = torch.zeros((1, 1), dtype=_I32, device=q.device)
    lens = torch.full((1,), kv.shape[0], dtype=_I32, device=q.device)   # made on the device: no host copy
    out, lse = backend.kernels.sparse_mla_decode_paged(q.unsqueeze(0), kv.unsqueeze(0), one, lens,
                                                       indices.unsqueeze(0), sm_scale, d_v, backend.stream(q.device))
    return out.squeeze(0), lse.squeeze(0)


SPARSE_MLA_ATTENTION = Adapter("sparse_mla_attention", sparse_mla_attention, dtypes=FLOATS,
                               supports_metadata=sparse_mla_attention_supported)


# -- kernel-only adapters ------------------------------------------------------------------------
def indexer_shape_declined(q: Tensor) -> str | None:
    heads, dim = q.shape[-2], q.shape[-1]
    if heads > INDEXER_MAX_HEADS or heads * dim > INDEXER_MAX_QROW:
        return (f"the indexer kernel keeps one query row in shared memory: heads <= {INDEXER_MAX_HEADS} and "
                f"heads * D <= {INDEXER_MAX_QROW}, got {heads} x {dim}")
    return None


def silu_and_mul_supported(backend: Any, x: Tensor) -> Verdict:
    return backend.kernels.missing() or True


def silu_and_mul(backend: Any, x: Tensor) -> Tensor:
    return backend.kernels.silu_and_mul(x, backend.stream(x.device))


def kv_cache_write_supported(backend: Any, cache: Tensor, values: Tensor, slot_mapping: Tensor) -> Verdict:
    return first_reason(
        backend.kernels.missing,
        lambda: None if cache.is_contiguous() else "the kv_cache_write kernel writes a contiguous cache")


def kv_cache_write(backend: Any, cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    backend.kernels.kv_cache_write(cache, values, slot_mapping, backend.stream(cache.device))


def indexer_topk_supported(backend: Any, q: Tensor, k: Any, weights: Tensor, k_start: Tensor, k_end: Tensor,
                           topk: int) -> Verdict:
    return first_reason(backend.kernels.missing, lambda: indexer_shape_declined(q))


def indexer_topk(backend: Any, q: Tensor, k: Any, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    keys, scale = split_key(k)
    return backend.kernels.indexer_topk(q, keys, scale, weights, k_start, k_end, topk, backend.stream(q.device))


def indexer_topk_paged_supported(backend: Any, q: Tensor, k_cache: Any, weights: Tensor, block_table: Tensor,
                                 context_lens: Tensor, topk: int) -> Verdict:
    return first_reason(backend.kernels.missing, lambda: indexer_shape_declined(q))


def indexer_topk_paged(backend: Any, q: Tensor, k_cache: Any, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    keys, scale = split_key(k_cache)
    return backend.kernels.indexer_topk_paged(q, keys, scale, weights, block_table, context_lens, topk,
                                              backend.stream(q.device))


def moe_permute_supported(backend: Any, x: Tensor, ids: Tensor, num_experts: int) -> Verdict:
    return backend.kernels.missing() or True


def moe_permute(backend: Any, x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    return backend.kernels.moe_permute(x, ids, num_experts, backend.stream(x.device))


def moe_unpermute_supported(backend: Any, y: Tensor, src: Tensor, weights: Tensor) -> Verdict:
    return backend.kernels.missing() or True


def moe_unpermute(backend: Any, y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    return backend.kernels.moe_unpermute(y, src, weights, backend.stream(y.device))


SILU_AND_MUL = Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS, supports_metadata=silu_and_mul_supported)
# per call: reads the cache's contiguity (the call key holds only whether it is paged)
KV_CACHE_WRITE = Adapter("kv_cache_write", kv_cache_write, supports=kv_cache_write_supported)
INDEXER_TOPK = Adapter("indexer_topk", indexer_topk, dtypes=FLOATS, supports_metadata=indexer_topk_supported)
INDEXER_TOPK_PAGED = Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=FLOATS,
                             supports_metadata=indexer_topk_paged_supported)
MOE_PERMUTE = Adapter("moe_permute", moe_permute, dtypes=FLOATS, supports_metadata=moe_permute_supported)
MOE_UNPERMUTE = Adapter("moe_unpermute", moe_unpermute, dtypes=FLOATS, supports_metadata=moe_unpermute_supported)
