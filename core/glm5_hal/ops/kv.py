"""Paged KV cache ops (OPS.md section 6): writing token rows into cache slots and gathering
sequences back out through block tables.

A cache is `[num_blocks, block_size, D]`; slot `s` is row `s` of `cache.view(-1, D)`, i.e.
block `s // block_size`, offset `s % block_size`. `glm5_hal.kv.PagedKVCache` hands out slot
mappings and block tables for these ops.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import checks as C
from .. import reference as ref
from ..registry import OpDef, define

__all__ = ["kv_cache_write", "indexer_k_cache_write", "kv_cache_gather"]

CACHE_DTYPES = (*C.FLOAT_DTYPES, C.FP8)
SCALE_FMTS = (None, "ue8m0")


def _check_cache(op: str, arg: str, cache) -> None:
    C.tensor(op, arg, cache, ndim=3, dtypes=CACHE_DTYPES)
    C.contiguous(op, arg, cache)


def _check_slot_mapping(op: str, slot_mapping, tokens: int) -> None:
    C.tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=C.SLOT_DTYPES)
    C.shape(op, "slot_mapping", slot_mapping, [tokens])


def _check_slot_values(op: str, slot_mapping: Tensor, num_slots: int) -> None:
    C.index_range(op, "slot_mapping", slot_mapping, 0, num_slots, allow=(-1,))
    # Two tokens writing one slot would make the result depend on write order, which
    # backends cannot agree on: rejected rather than left unspecified.
    used = slot_mapping[slot_mapping >= 0].sort().values
    repeated = used[1:][used[1:] == used[:-1]]
    if repeated.numel():
        C.fail(op, "slot_mapping", "distinct slots (-1 may repeat)",
               f"slot {int(repeated[0])} more than once")


# -- kv_cache_write ---------------------------------------------------------------------------
def _check_kv_cache_write(cache, values, slot_mapping):
    op = "kv_cache_write"
    _check_cache(op, "cache", cache)
    C.tensor(op, "values", values, ndim=2)
    C.same_dtype(op, "cache", cache, "values", values)
    C.shape(op, "values", values, [None, cache.shape[2]])
    _check_slot_mapping(op, slot_mapping, values.shape[0])
    C.same_device(op, "cache", cache, values=values, slot_mapping=slot_mapping)


def _check_kv_cache_write_values(cache, values, slot_mapping):
    _check_slot_values("kv_cache_write", slot_mapping, cache.shape[0] * cache.shape[1])


_KV_CACHE_WRITE = define(OpDef(
    name="kv_cache_write",
    schema="(Tensor(a!) cache, Tensor values, Tensor slot_mapping) -> ()",
    reference=ref.kv_cache_write,
    check=_check_kv_cache_write,
    check_values=_check_kv_cache_write_values,
    fake=lambda cache, values, slot_mapping: None,
    dispatch_arg="cache",
))


def kv_cache_write(cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    """Writes token rows into cache slots, in place.

    cache:        [num_blocks, block_size, D] bfloat16 | float16 | float32 | float8_e4m3fn,
                  contiguous; modified in place (for MLA a row is cat(c_kv[512], k_pe[64]))
    values:       [T, D], same dtype as cache
    slot_mapping: [T] int32 | int64; slot s is cache.view(-1, D)[s]; -1 = padding, not written
    Slots outside [0, num_blocks * block_size) (other than -1) and a slot given twice raise
    InvalidInputError before anything is written. Returns None.
    """
    _KV_CACHE_WRITE(cache, values, slot_mapping)


# -- indexer_k_cache_write --------------------------------------------------------------------
def _check_indexer_k_cache_write(k, k_cache, k_scale, slot_mapping, scale_fmt):
    op = "indexer_k_cache_write"
    C.tensor(op, "k", k, ndim=2, dtypes=C.FLOAT_DTYPES)
    if k.shape[1] < 1:
        C.fail(op, "k", "shape [T, D] with D >= 1", f"shape {list(k.shape)}")
    C.tensor(op, "k_cache", k_cache, ndim=3, dtypes=(C.FP8,))
    C.shape(op, "k_cache", k_cache, [None, None, k.shape[1]])
    C.contiguous(op, "k_cache", k_cache)
    C.tensor(op, "k_scale", k_scale, ndim=2, dtypes=(torch.float32,))
    C.shape(op, "k_scale", k_scale, [k_cache.shape[0], k_cache.shape[1]])
    C.contiguous(op, "k_scale", k_scale)
    _check_slot_mapping(op, slot_mapping, k.shape[0])
    C.choice(op, "scale_fmt", scale_fmt, SCALE_FMTS)
    C.same_device(op, "k", k, k_cache=k_cache, k_scale=k_scale, slot_mapping=slot_mapping)


def _check_indexer_k_cache_write_values(k, k_cache, k_scale, slot_mapping, scale_fmt):
    _check_slot_values("indexer_k_cache_write", slot_mapping, k_cache.shape[0] * k_cache.shape[1])


_INDEXER_K_CACHE_WRITE = define(OpDef(
    name="indexer_k_cache_write",
    schema=("(Tensor k, Tensor(a!) k_cache, Tensor(b!) k_scale, Tensor slot_mapping, "
            "str? scale_fmt) -> ()"),
    reference=ref.indexer_k_cache_write,
    check=_check_indexer_k_cache_write,
    check_values=_check_indexer_k_cache_write_values,
    fake=lambda k, k_cache, k_scale, slot_mapping, scale_fmt: None,
    dispatch_arg="k",
))


def indexer_k_cache_write(k: Tensor, k_cache: Tensor, k_scale: Tensor, slot_mapping: Tensor,
                          scale_fmt: str | None = None) -> None:
    """FP8-quantizes indexer keys (one scale per row) and writes them into a paged cache.

    k:            [T, D] bfloat16 | float16 | float32 (D = 128 for the DSA indexer), D >= 1
    k_cache:      [num_blocks, block_size, D] float8_e4m3fn, contiguous; modified in place
    k_scale:      [num_blocks, block_size] float32, contiguous; modified in place
    slot_mapping: [T] int32 | int64, as in kv_cache_write (-1 = padding; out of range or
                  repeated slots raise before anything is written)
    scale_fmt:    None or "ue8m0" (scales rounded up to a power of two)
    Each row is quantized as one block of D (fp8_block_quant's rule): the slot's k_cache row
    gets the FP8 values, its k_scale entry the scale (dequant: k_cache.float() * k_scale).
    Returns None.
    """
    _INDEXER_K_CACHE_WRITE(k, k_cache, k_scale, slot_mapping, scale_fmt)


# -- kv_cache_gather --------------------------------------------------------------------------
def _check_kv_cache_gather(cache, block_table, context_lens):
    op = "kv_cache_gather"
    C.tensor(op, "cache", cache, ndim=3, dtypes=CACHE_DTYPES)
    C.tensor(op, "block_table", block_table, ndim=2, dtypes=C.INDEX_DTYPES)
    C.tensor(op, "context_lens", context_lens, ndim=1, dtypes=C.INDEX_DTYPES)
    C.shape(op, "context_lens", context_lens, [block_table.shape[0]])
    C.same_device(op, "cache", cache, block_table=block_table, context_lens=context_lens)


def _check_kv_cache_gather_values(cache, block_table, context_lens):
    op = "kv_cache_gather"
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    max_blocks = block_table.shape[1]
    C.index_range(op, "context_lens", context_lens, 0, max_blocks * block_size + 1)
    if block_table.numel() == 0:
        return
    used_blocks = (context_lens.long() + block_size - 1) // block_size
    used = torch.arange(max_blocks, device=block_table.device) < used_blocks.unsqueeze(1)
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        C.fail(op, "block_table", f"block ids in [0, {num_blocks}) for the "
               f"ceil(context_lens / {block_size}) blocks in use",
               f"{int(block_table[b, j])} at [{b}, {j}] (context_lens[{b}] = {int(context_lens[b])})")


def _fake_kv_cache_gather(cache, block_table, context_lens):
    tokens = torch.library.get_ctx().new_dynamic_size()
    return cache.new_empty(tokens, cache.shape[2])


_KV_CACHE_GATHER = define(OpDef(
    name="kv_cache_gather",
    schema="(Tensor cache, Tensor block_table, Tensor context_lens) -> Tensor",
    reference=ref.kv_cache_gather,
    check=_check_kv_cache_gather,
    check_values=_check_kv_cache_gather_values,
    fake=_fake_kv_cache_gather,
    dispatch_arg="cache",
))


def kv_cache_gather(cache: Tensor, block_table: Tensor, context_lens: Tensor) -> Tensor:
    """The logical contents of paged sequences, concatenated in batch order.

    cache:        [num_blocks, block_size, D] bfloat16 | float16 | float32 | float8_e4m3fn
    block_table:  [B, max_blocks] int32; position p of sequence b lives in block
                  block_table[b, p // block_size]; entries past the ceil(len / block_size)
                  blocks in use are ignored (e.g. -1 padding)
    context_lens: [B] int32, 0 <= context_lens[b] <= max_blocks * block_size
    returns [sum(context_lens), D] like cache (a data-dependent size under torch.compile).
    """
    return _KV_CACHE_GATHER(cache, block_table, context_lens)
