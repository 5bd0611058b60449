"""Paged KV cache ops (docs/ops/kv.md): writing token rows into cache slots and gathering
sequences back out through block tables.

A cache is `[num_blocks, block_size, D]`; slot `s` is block `s // block_size`, offset
`s % block_size` (row `s` of `cache.view(-1, D)` when the cache is contiguous). The writes
take any *paged* layout: each block contiguous, blocks apart, as in vLLM's page views. `glm5_hal.kv.PagedKVCache` hands out slot
mappings and block tables for these ops.
"""
from __future__ import annotations

import torch

from .. import checks as C
from .. import reference as ref
from ..checks import FLOAT_DTYPES as FLOAT, FP8, INDEX_DTYPES as INDEX, SLOT_DTYPES
from ..contract import Choice, Rule, Tensor
from ..opdef import define, defined_in

CACHE_DTYPES = (*FLOAT, FP8)
SCALE_FMTS = (None, "ue8m0")


def _check_write_values(op: str, slot_mapping: torch.Tensor, cache: torch.Tensor,
                        other: torch.Tensor | None = None, other_arg: str = "") -> None:
    """A cache write's value checks: the second written cache `other` (argument `other_arg`)
    shares no byte with `cache`, and slot_mapping's slots are in range and distinct."""
    kind, at = C.first_bad_write(slot_mapping, cache, other)
    if kind == 3:
        C.fail(op, other_arg, C.OVERLAP_EXPECTED, "an overlapping view")
    if kind == 1:
        shape = cache.shape
        num_slots = shape[0] * shape[1]
        C.fail(op, "slot_mapping", f"values in [0, {num_slots}) (or -1)",
               f"{int(slot_mapping.flatten()[at])} at flat index {at}")
    # Two tokens writing one slot would make the result depend on write order, which
    # backends cannot agree on: rejected rather than left unspecified.
    if kind == 2:
        C.fail(op, "slot_mapping", "distinct slots (-1 may repeat)", f"slot {at} more than once")


kv_cache_write = define(
    ref.kv_cache_write,
    args=dict(cache=Tensor("num_blocks, block_size, D", CACHE_DTYPES, paged=True),
              values=Tensor("T, D", "cache"), slot_mapping=Tensor("T", SLOT_DTYPES)),
    check_values=lambda cache, values, slot_mapping: _check_write_values("kv_cache_write", slot_mapping, cache),
    fake=lambda cache, values, slot_mapping: None,
    mutates=("cache",),
    doc="""Writes token rows into cache slots, in place.

    cache:        [num_blocks, block_size, D] bfloat16 | float16 | float32 | float8_e4m3fn,
                  paged (each block contiguous, blocks apart: a contiguous cache, or a
                  serving engine's block-strided view); modified in place (for MLA a row is
                  cat(c_kv[512], k_pe[64]))
    values:       [T, D], same dtype as cache
    slot_mapping: [T] int32 | int64; slot s is cache[s // block_size, s % block_size];
                  -1 = padding, not written
    Slots outside [0, num_blocks * block_size) (other than -1) and a slot given twice raise
    InvalidInputError before anything is written. Returns None.
    """)

indexer_k_cache_write = define(
    ref.indexer_k_cache_write,
    args=dict(k=Tensor("T, D", FLOAT), k_cache=Tensor("num_blocks, block_size, D", (FP8,), paged=True),
              k_scale=Tensor("num_blocks, block_size", (torch.float32,), paged=True),
              slot_mapping=Tensor("T", SLOT_DTYPES), scale_fmt=Choice(SCALE_FMTS)),
    rules=[Rule("k", "D >= 1", "shape [T, D] with D >= 1")],
    check_values=lambda k, k_cache, k_scale, slot_mapping, scale_fmt: _check_write_values(
        "indexer_k_cache_write", slot_mapping, k_cache, k_scale, "k_scale"),
    fake=lambda k, k_cache, k_scale, slot_mapping, scale_fmt: None,
    mutates=("k_cache", "k_scale"),
    doc="""FP8-quantizes indexer keys (one scale per row) and writes them into a paged cache.

    k:            [T, D] bfloat16 | float16 | float32 (D = 128 for the DSA indexer), D >= 1
    k_cache:      [num_blocks, block_size, D] float8_e4m3fn, paged; modified in place
    k_scale:      [num_blocks, block_size] float32, paged; modified in place. It may interleave
                  with k_cache page by page (vLLM's indexer page: a block's FP8 rows, then its
                  scales) but share no byte with it
    slot_mapping: [T] int32 | int64, as in kv_cache_write (-1 = padding; out of range or
                  repeated slots raise before anything is written)
    scale_fmt:    None or "ue8m0" (scales rounded up to a power of two)
    Each row is quantized as one block of D (fp8_block_quant's rule): the slot's k_cache row
    gets the FP8 values, its k_scale entry the scale (dequant: k_cache.float() * k_scale).
    Returns None.
    """)


def _check_kv_cache_gather_values(cache, block_table, context_lens):
    op = "kv_cache_gather"
    shape = cache.shape
    num_blocks, block_size = shape[0], shape[1]
    kind, b, j = C.first_bad_paging(block_table, context_lens, block_size, num_blocks)
    if kind == 1:
        C.fail(op, "context_lens", f"values in [0, {block_table.shape[1] * block_size + 1})",
               f"{int(context_lens[b])} at flat index {b}")
    if kind == 2:
        C.fail(op, "block_table", f"block ids in [0, {num_blocks}) for the "
               f"ceil(context_lens / {block_size}) blocks in use",
               f"{int(block_table[b, j])} at [{b}, {j}] (context_lens[{b}] = {int(context_lens[b])})")


def _fake_kv_cache_gather(cache, block_table, context_lens):
    tokens = torch.library.get_ctx().new_dynamic_size()
    return cache.new_empty(tokens, cache.shape[2])


kv_cache_gather = define(
    ref.kv_cache_gather,
    args=dict(cache=Tensor("num_blocks, block_size, D", CACHE_DTYPES),
              block_table=Tensor("B, max_blocks", INDEX), context_lens=Tensor("B", INDEX)),
    rules=[Rule("cache", "block_size >= 1", "shape [num_blocks, block_size, D] with block_size >= 1")],
    check_values=_check_kv_cache_gather_values,
    fake=_fake_kv_cache_gather,
    doc="""The logical contents of paged sequences, concatenated in batch order.

    cache:        [num_blocks, block_size, D] bfloat16 | float16 | float32 | float8_e4m3fn,
                  block_size >= 1
    block_table:  [B, max_blocks] int32; position p of sequence b lives in block
                  block_table[b, p // block_size]; entries past the ceil(len / block_size)
                  blocks in use are ignored (e.g. -1 padding)
    context_lens: [B] int32, 0 <= context_lens[b] <= max_blocks * block_size
    returns [sum(context_lens), D] like cache (a data-dependent size under torch.compile).
    """)

__all__ = defined_in(__name__)
