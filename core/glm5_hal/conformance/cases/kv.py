"""Cases for the paged KV cache ops (docs/ops/kv.md).

The writes are judged on their whole destinations (rule 4), which start out filled with
random values, so a write into a neighbouring or a padding slot, or a zeroed row, shows.
Moves are bit-exact; the indexer key cache holds FP8 codes (`Fp8Codes`, as
`fp8_block_quant`) and their scales. Invalid slot mappings and block tables must raise
`InvalidInputError` and leave the destinations untouched.
"""
from __future__ import annotations

import torch

from ..case import ERROR, RESULT, RESULT_OR_ERROR, Case, View, randn, uniform
from ..compare import Close, Exact
from ..transforms import Fp8Codes
from ...presets import GLM5
from . import generator
from .quant import FP8_TIES

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*FLOATS, torch.float8_e4m3fn)
GLM5_BLOCK_SIZE = 64                                          # the paged KV block size
MLA_ROW = GLM5.kv_lora_rank + GLM5.qk_rope_head_dim           # 576 = c_kv 512 + k_pe 64
INDEXER_ROW = GLM5.index_head_dim                             # 128
_SCALES = {None: Close(dtype=torch.float32), "ue8m0": Exact(dtype=torch.float32)}


def random_rows(g: torch.Generator, shape, dtype: torch.dtype) -> torch.Tensor:
    """Normal values in `dtype`; FP8 ones spread over its range (and never NaN)."""
    if dtype == torch.float8_e4m3fn:
        return (torch.randn(shape, generator=g) * 64).clamp(-448, 448).to(dtype)
    return randn(g, shape, dtype)


def distinct_slots(g: torch.Generator, num_slots: int, tokens: int) -> torch.Tensor:
    return torch.randperm(num_slots, generator=g)[:tokens]


def _slot_mapping(g, num_slots, tokens, block_size, spec, padding, slot_dtype):
    """spec: "random" (distinct slots anywhere), "every_slot" (a permutation of all of them),
    "prefill" (consecutive positions from offset 30 of a sequence whose blocks are random),
    or an explicit list. `padding`: token indices set to -1."""
    if spec == "random":
        slots = distinct_slots(g, num_slots, tokens)
    elif spec == "every_slot":
        slots = torch.randperm(num_slots, generator=g)
    elif spec == "prefill":
        blocks = torch.randperm(num_slots // block_size, generator=g)
        pos = torch.arange(tokens) + 30
        slots = blocks[pos // block_size] * block_size + pos % block_size
    else:
        slots = torch.tensor(spec)
    slots = slots.to(torch.int64)
    slots[list(padding)] = -1
    return slots.to(slot_dtype)


# -- kv_cache_write ----------------------------------------------------------------------------
def _write_case(preset, name, dtype, num_blocks, block_size, dim, tokens, *, slots="random",
                padding=(), slot_dtype=torch.int32, view=None, outcome=RESULT, note=""):
    """view: "values_slice" (values are the first `dim` of wider rows), "slots_strided",
    "cache_slice" (rows cut from wider rows: not a paged layout, an error), "cache_pages"
    (each block a page of a larger buffer: vLLM's block-strided layout, written in place)."""
    def inputs(g):
        cache = random_rows(g, (num_blocks, block_size, dim), dtype)
        values = random_rows(g, (tokens, dim), dtype)
        mapping = _slot_mapping(g, num_blocks * block_size, tokens, block_size, slots, padding,
                                slot_dtype)
        if view == "values_slice":
            values = View(torch.cat((values, random_rows(g, (tokens, 7), dtype)), 1),
                          lambda b: b[:, :dim])
        elif view == "slots_strided":
            mapping = View(torch.stack((mapping, mapping.flip(0)), 1).flatten(), lambda b: b[::2])
        elif view == "cache_slice":
            cache = View(torch.cat((cache, random_rows(g, (num_blocks, block_size, 3), dtype)), 2),
                         lambda b: b[..., :dim])
        elif view == "cache_pages":
            cache = View(torch.cat((cache, random_rows(g, (num_blocks, 2, dim), dtype)), 1),
                         lambda b: b[:, :block_size])
        return cache, values, mapping

    if view in ("values_slice", "slots_strided"):
        outcome = RESULT_OR_ERROR
    checks = {} if outcome == ERROR else {"cache": Exact()}
    return Case("kv_cache_write", preset, name, dtype, inputs, checks, outcome=outcome, note=note)


@generator("kv_cache_write")
def kv_cache_write_cases(preset: str):
    for dtype in CACHE_DTYPES:
        if preset == "tiny":
            yield _write_case(preset, "nb3_bs1_d1", dtype, 3, 1, 1, 2)
            yield _write_case(preset, "nb5_bs3_d17", dtype, 5, 3, 17, 7)
            yield _write_case(preset, "nb4_bs17_d129", dtype, 4, 17, 129, 17)
            yield _write_case(preset, "padding_slots", dtype, 4, 3, 17, 6, padding=(0, 2, 5),
                              note="-1 writes nothing, first and last token included")
            yield _write_case(preset, "all_padding", dtype, 2, 3, 5, 3, padding=(0, 1, 2))
            yield _write_case(preset, "int64_slots", dtype, 3, 5, 9, 4, slot_dtype=torch.int64)
            yield _write_case(preset, "every_slot", dtype, 3, 5, 9, 15, slots="every_slot",
                              note="every slot of the cache written once")
            yield _write_case(preset, "first_and_last_slot", dtype, 3, 5, 9, 2, slots=[14, 0])
            yield _write_case(preset, "empty_batch", dtype, 2, 3, 5, 0)
            yield _write_case(preset, "noncontig_values", dtype, 3, 5, 9, 4, view="values_slice")
            yield _write_case(preset, "noncontig_slots", dtype, 3, 5, 9, 4, view="slots_strided")
            yield _write_case(preset, "slot_out_of_range", dtype, 3, 5, 9, 3, slots=[0, 15, 4],
                              outcome=ERROR, note="slot num_blocks * block_size")
            yield _write_case(preset, "slot_below_minus_one", dtype, 3, 5, 9, 3, slots=[0, -2, 4],
                              outcome=ERROR, note="-1 is padding, -2 is an error")
            yield _write_case(preset, "duplicate_slots", dtype, 3, 5, 9, 4, slots=[3, 7, -1, 3],
                              outcome=ERROR, note="two tokens into one slot")
            yield _write_case(preset, "noncontig_cache", dtype, 3, 5, 9, 3, view="cache_slice",
                              outcome=ERROR, note="rows cut from wider rows: not a paged layout")
            yield _write_case(preset, "paged_view_cache", dtype, 3, 5, 9, 6, view="cache_pages",
                              note="each block a page of a larger buffer (vLLM's layout), written in place")
        elif preset == "glm5":
            nb, bs, d = 12, GLM5_BLOCK_SIZE, MLA_ROW
            yield _write_case(preset, "mla_decode_t5", dtype, nb, bs, d, 5,
                              note="one token of each of 5 sequences into the 576-wide MLA cache")
            yield _write_case(preset, "mla_decode_padded", dtype, nb, bs, d, 8, padding=(5, 6, 7),
                              note="a decode batch padded to 8 (graph capture) with -1")
            yield _write_case(preset, "mla_prefill_t70", dtype, nb, bs, d, 70, slots="prefill",
                              note="a prefill chunk crossing from one block into another")
            yield _write_case(preset, "mla_rows_of_wider_tensor", dtype, nb, bs, d, 5,
                              view="values_slice", note="cache rows cut from wider rows")


# -- indexer_k_cache_write -------------------------------------------------------------------
def _key_rows(g, tokens, dim, dtype, fill):
    """fill: "zero_row" (row 1 all zero: the amax floor), "below_floor" (|k| < 1e-4),
    "ties" (rows of FP8_TIES times 1, 2^-3, 4, -1: exact e4m3 midpoints, dim 16)."""
    if fill == "ties":
        base = torch.tensor(FP8_TIES)
        return torch.stack([base, base * 2 ** -3, base * 4, -base])[:tokens].to(dtype)
    # rows of different magnitudes, so that their scales differ (a scale in the wrong slot shows)
    k = randn(g, (tokens, dim), torch.float32) * torch.exp(uniform(g, (tokens, 1), torch.float32, -2, 2))
    if fill == "zero_row":
        k[1] = 0
    elif fill == "below_floor":
        k = k * 2e-5
    return k.to(dtype)


def _index_write_case(preset, name, dtype, scale_fmt, num_blocks, block_size, dim, tokens, *,
                      slots="random", padding=(), slot_dtype=torch.int32, fill=None, view=None,
                      outcome=RESULT, note=""):
    """view: "k_slice" (k rows cut from wider rows), "slots_strided", "pages" (k_cache and
    k_scale each a block-strided view of larger pages, as vLLM's indexer pages)."""
    def inputs(g):
        k_cache = random_rows(g, (num_blocks, block_size, dim), torch.float8_e4m3fn)
        k_scale = uniform(g, (num_blocks, block_size), torch.float32, 1e-3, 5e-2)
        k = _key_rows(g, tokens, dim, dtype, fill)
        mapping = _slot_mapping(g, num_blocks * block_size, tokens, block_size, slots, padding,
                                slot_dtype)
        if view == "k_slice":
            k = View(torch.cat((randn(g, (tokens, 5), dtype), k), 1), lambda b: b[:, 5:])
        elif view == "slots_strided":
            mapping = View(torch.stack((mapping, mapping.flip(0)), 1).flatten(), lambda b: b[::2])
        elif view == "pages":
            spare = random_rows(g, (num_blocks, 3, dim), torch.float8_e4m3fn)
            k_cache = View(torch.cat((k_cache, spare), 1), lambda b: b[:, :block_size])
            spare_scales = uniform(g, (num_blocks, 3), torch.float32, 1e-3, 5e-2)
            k_scale = View(torch.cat((k_scale, spare_scales), 1), lambda b: b[:, :block_size])
        return k, k_cache, k_scale, mapping, scale_fmt

    if view in ("k_slice", "slots_strided"):
        outcome = RESULT_OR_ERROR
    checks = {} if outcome == ERROR else {
        "k_cache": Exact(transform=Fp8Codes("k_scale", source="k", slots="slot_mapping")),
        "k_scale": _SCALES[scale_fmt]}
    fmt = "ue8m0" if scale_fmt == "ue8m0" else "fp32scale"
    return Case("indexer_k_cache_write", preset, f"{name}_{fmt}", dtype, inputs, checks,
                outcome=outcome, note=note)


@generator("indexer_k_cache_write")
def indexer_k_cache_write_cases(preset: str):
    for dtype in FLOATS:
        for fmt in (None, "ue8m0"):
            case = lambda *a, **kw: _index_write_case(preset, *a, **kw)
            if preset == "tiny":
                yield case("nb3_bs1_d1", dtype, fmt, 3, 1, 1, 2, note="a row of one: always +-448")
                yield case("nb5_bs3_d17", dtype, fmt, 5, 3, 17, 7)
                yield case("nb4_bs17_d129", dtype, fmt, 4, 17, 129, 17)
                yield case("nb3_bs16_d128", dtype, fmt, 3, 16, 128, 5,
                           note="the indexer's real key width at a vendor block size")
                yield case("padding_slots", dtype, fmt, 4, 3, 17, 6, padding=(0, 2, 5))
                yield case("int64_slots", dtype, fmt, 3, 5, 16, 4, slot_dtype=torch.int64)
                yield case("every_slot", dtype, fmt, 2, 3, 16, 6, slots="every_slot")
                yield case("rounding_ties", dtype, fmt, 3, 5, 16, 4, fill="ties",
                           note="exact e4m3 midpoints must round to even")
                yield case("zero_row", dtype, fmt, 3, 5, 16, 3, fill="zero_row",
                           note="an all-zero key: the amax floor 1e-4, codes 0")
                yield case("below_floor", dtype, fmt, 3, 5, 16, 3, fill="below_floor")
                yield case("empty_batch", dtype, fmt, 2, 3, 16, 0)
                yield case("noncontig_k", dtype, fmt, 3, 5, 16, 4, view="k_slice")
                yield case("noncontig_slots", dtype, fmt, 3, 5, 16, 4, view="slots_strided")
                yield case("paged_views", dtype, fmt, 3, 5, 16, 6, view="pages",
                           note="rows and scales block-strided views of larger pages (vLLM's layout)")
                yield case("slot_out_of_range", dtype, fmt, 3, 5, 16, 3, slots=[0, 15, 4], outcome=ERROR)
                yield case("duplicate_slots", dtype, fmt, 3, 5, 16, 3, slots=[2, 2, 4], outcome=ERROR)
            elif preset == "glm5":
                nb, bs, d = 12, GLM5_BLOCK_SIZE, INDEXER_ROW
                yield case("decode_t5", dtype, fmt, nb, bs, d, 5,
                           note="indexer keys of 5 sequences into the [nb, 64, 128] FP8 cache")
                yield case("decode_padded", dtype, fmt, nb, bs, d, 8, padding=(5, 6, 7))
                yield case("prefill_t70", dtype, fmt, nb, bs, d, 70, slots="prefill",
                           note="a prefill chunk crossing from one block into another")


# -- kv_cache_gather ---------------------------------------------------------------------------
def _block_table(g, num_blocks, block_size, lens, max_blocks, *, fill=-1, shared_prefix=0,
                 bad=None):
    """Distinct random blocks for each sequence's ceil(len / block_size) used entries; the
    rest `fill` (ignored by the op). shared_prefix: sequence 1 starts with sequence 0's first
    blocks (prefix caching). bad: (b, j, value) overwrites one entry."""
    used = [min((n + block_size - 1) // block_size, max_blocks) for n in lens]
    pool = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(lens), max_blocks), fill, dtype=torch.int32)
    for b, u in enumerate(used):
        share = shared_prefix if b == 1 else 0
        own = [pool.pop() for _ in range(u - share)]
        table[b, :u] = torch.tensor(table[0, :share].tolist() + own, dtype=torch.int32)
    if bad is not None:
        b, j, value = bad
        table[b, j] = value
    return table


def _gather_case(preset, name, dtype, num_blocks, block_size, dim, lens, max_blocks, *, fill=-1,
                 shared_prefix=0, bad=None, view=None, outcome=RESULT, note=""):
    """view: "cache_slice" (the first `dim` of wider cache rows: the c_kv part of the MLA
    cache), "table_slice" (the first max_blocks columns of a wider table)."""
    def inputs(g):
        cache = random_rows(g, (num_blocks, block_size, dim), dtype)
        table = _block_table(g, num_blocks, block_size, lens, max_blocks, fill=fill,
                             shared_prefix=shared_prefix, bad=bad)
        context_lens = torch.tensor(lens, dtype=torch.int32)
        if view == "cache_slice":
            cache = View(torch.cat((cache, random_rows(g, (num_blocks, block_size, 64), dtype)), 2),
                         lambda b: b[..., :dim])
        elif view == "table_slice":
            table = View(torch.cat((table, torch.full((len(lens), 3), -1, dtype=torch.int32)), 1),
                         lambda b: b[:, :max_blocks])
        return cache, table, context_lens

    if view is not None:
        outcome = RESULT_OR_ERROR
    checks = {} if outcome == ERROR else {"out": Exact()}
    return Case("kv_cache_gather", preset, name, dtype, inputs, checks, outcome=outcome, note=note)


@generator("kv_cache_gather")
def kv_cache_gather_cases(preset: str):
    for dtype in CACHE_DTYPES:
        if preset == "tiny":
            yield _gather_case(preset, "b1_len1_bs1_d1", dtype, 3, 1, 1, [1], 2)
            yield _gather_case(preset, "b3_bs3_d17", dtype, 9, 3, 17, [4, 1, 7], 3,
                               note="lengths ending inside a block")
            yield _gather_case(preset, "b2_bs17_d129", dtype, 6, 17, 129, [17, 35], 3,
                               note="a whole block, then one token into the third")
            yield _gather_case(preset, "max_table_fill", dtype, 8, 3, 5, [12, 12], 4,
                               note="context_lens = max_blocks * block_size")
            yield _gather_case(preset, "zero_length_sequence", dtype, 6, 3, 5, [4, 0, 2], 2)
            yield _gather_case(preset, "ignored_table_tail", dtype, 6, 3, 5, [2, 4], 4, fill=99,
                               note="entries past the used blocks are ignored, even out of range")
            yield _gather_case(preset, "shared_prefix", dtype, 8, 3, 5, [7, 8], 3, shared_prefix=2,
                               note="two sequences reading the same first blocks")
            yield _gather_case(preset, "empty_batch", dtype, 4, 3, 5, [], 2)
            yield _gather_case(preset, "noncontig_cache", dtype, 6, 3, 7, [5, 4], 2, view="cache_slice")
            yield _gather_case(preset, "noncontig_table", dtype, 6, 3, 7, [5, 4], 2, view="table_slice")
            yield _gather_case(preset, "block_out_of_range", dtype, 6, 3, 5, [5, 4], 2, bad=(1, 1, 6),
                               outcome=ERROR, note="block id num_blocks in a used entry")
            yield _gather_case(preset, "padding_in_used_entry", dtype, 6, 3, 5, [5, 4], 2,
                               bad=(0, 1, -1), outcome=ERROR, note="-1 where a used block belongs")
            yield _gather_case(preset, "context_len_past_table", dtype, 6, 3, 5, [7, 4], 2,
                               outcome=ERROR, note="context_lens > max_blocks * block_size")
        elif preset == "glm5":
            lens, max_blocks = [1, 64, 65, 200], 4
            if dtype != torch.float8_e4m3fn:
                yield _gather_case(preset, "mla_b4", dtype, 24, GLM5_BLOCK_SIZE, MLA_ROW, lens,
                                   max_blocks, note="the [nb, 64, 576] MLA cache; 200 fills the table")
                yield _gather_case(preset, "mla_shared_prefix", dtype, 24, GLM5_BLOCK_SIZE, MLA_ROW,
                                   [130, 150], 3, shared_prefix=2,
                                   note="prefix caching: two sequences share two blocks")
                yield _gather_case(preset, "mla_latent_part", dtype, 24, GLM5_BLOCK_SIZE,
                                   GLM5.kv_lora_rank, lens, max_blocks, view="cache_slice",
                                   note="c_kv: the first 512 of the 576-wide rows")
            else:
                yield _gather_case(preset, "indexer_keys_b4", dtype, 24, GLM5_BLOCK_SIZE, INDEXER_ROW,
                                   lens, max_blocks, note="the [nb, 64, 128] FP8 indexer key cache")
                yield _gather_case(preset, "mla_b4", dtype, 24, GLM5_BLOCK_SIZE, MLA_ROW, lens,
                                   max_blocks, note="an FP8 MLA cache")
