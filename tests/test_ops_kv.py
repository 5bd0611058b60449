"""Paged KV cache ops: kv_cache_write, indexer_k_cache_write, kv_cache_gather. In-place
writes are checked on the whole destination (untouched slots must stay untouched), bad slot
mappings must raise before anything is written, and gathers must equal the contiguous
sequences they page."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import glm5_hal as hal
from conftest import assert_invalid

REPO = Path(__file__).resolve().parents[1]
FP8 = torch.float8_e4m3fn
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, FP8]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_rows(n: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, d, generator=g) * 4).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view for exact comparison (float8 has no torch.equal kernel on the CPU;
    bits also make -0.0 and NaN payloads count)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


# -- kv_cache_write -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kv_cache_write_touches_exactly_the_given_slots(dtype, slot_dtype):
    g = gen(1)
    num_blocks, block_size, D = 5, 4, 24
    cache = random_rows(num_blocks * block_size, D, dtype, g).view(num_blocks, block_size, D)
    before = cache.clone()
    slots = [7, -1, 0, 19, -1, 12, 3]
    values = random_rows(len(slots), D, dtype, g)
    hal.ops.kv_cache_write(cache, values, torch.tensor(slots, dtype=slot_dtype))
    expected = before.view(-1, D).clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expected[s] = values[t]
    assert_same(cache.view(-1, D), expected)


def test_kv_cache_write_mla_rows_and_empty_batch():
    g = gen(2)
    cache = torch.zeros(3, 64, 576, dtype=torch.bfloat16)     # cat(c_kv[512], k_pe[64])
    c_kv, k_pe = random_rows(4, 512, torch.bfloat16, g), random_rows(4, 64, torch.bfloat16, g)
    slots = torch.tensor([130, 0, 191, 64], dtype=torch.int32)
    hal.ops.kv_cache_write(cache, torch.cat([c_kv, k_pe], dim=1), slots)
    flat = cache.view(-1, 576)
    assert_same(flat[slots.long(), :512], c_kv)
    assert_same(flat[slots.long(), 512:], k_pe)
    assert int((flat.abs().sum(1) != 0).sum()) == 4
    before = cache.clone()
    hal.ops.kv_cache_write(cache, torch.empty(0, 576, dtype=torch.bfloat16), torch.empty(0, dtype=torch.int64))
    assert_same(cache, before)


@pytest.mark.parametrize("slots,expected", [
    ([0, 5, 20], "values in [0, 20) (or -1)"),        # one past the end
    ([0, 5, -2], "values in [0, 20) (or -1)"),        # negative other than -1
    ([3, 9, 3], "slot 3 more than once"),              # duplicate
    ([-1, 4, -1, 19, 4], "slot 4 more than once"),     # -1 may repeat, 4 may not
])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kv_cache_write_bad_slots_raise_before_any_write(slots, expected, slot_dtype):
    g = gen(3)
    cache = random_rows(20, 8, torch.float32, g).view(5, 4, 8)
    before = cache.clone()
    values = random_rows(len(slots), 8, torch.float32, g)
    with pytest.raises(hal.InvalidInputError) as info:
        hal.ops.kv_cache_write(cache, values, torch.tensor(slots, dtype=slot_dtype))
    assert info.value.arg == "slot_mapping" and expected in str(info.value)
    assert_same(cache, before)


def test_kv_cache_write_large_int64_slot_is_rejected_not_wrapped():
    cache = torch.zeros(2, 2, 4)
    with pytest.raises(hal.InvalidInputError, match="slot_mapping"):
        hal.ops.kv_cache_write(cache, torch.ones(1, 4), torch.tensor([2**32 + 1]))
    assert not cache.any()


def test_kv_cache_write_under_compile_mutates_the_callers_cache():
    torch._dynamo.reset()

    def step(cache, values, slots):
        hal.ops.kv_cache_write(cache, values * 2, slots)
        return cache.sum()

    g = gen(4)
    a, b = torch.zeros(4, 3, 8), torch.zeros(4, 3, 8)
    values = torch.randn(5, 8, generator=g)
    slots = torch.tensor([11, -1, 0, 4, 7], dtype=torch.int32)
    total = torch.compile(step, fullgraph=True)(a, values, slots)
    step(b, values, slots)
    assert_same(a, b)
    torch.testing.assert_close(total, b.sum())


# -- indexer_k_cache_write --------------------------------------------------------------------------
def quantize_row_by_hand(row: torch.Tensor, scale_fmt):
    """docs/ops/quant.md for one block spanning the whole row."""
    amax = max(float(row.float().abs().max()), 1e-4)
    scale = torch.tensor(amax / 448.0, dtype=torch.float32)
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (row.float() / scale).clamp(-448, 448).to(FP8)
    return q, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_indexer_k_cache_write_whole_caches(dtype, scale_fmt, slot_dtype):
    g = gen(5)
    num_blocks, block_size, D = 4, 8, 128
    k_cache = random_rows(num_blocks * block_size, D, FP8, g).view(num_blocks, block_size, D)
    k_scale = torch.rand(num_blocks, block_size, generator=g)
    cache_before, scale_before = k_cache.clone(), k_scale.clone()
    slots = [31, -1, 2, 17, 8, -1]
    k = random_rows(len(slots), D, dtype, g)
    k[4] = 0  # an all-zero key uses the 1e-4 amax floor
    hal.ops.indexer_k_cache_write(k, k_cache, k_scale, torch.tensor(slots, dtype=slot_dtype), scale_fmt)
    want_cache, want_scale = cache_before.view(-1, D).clone(), scale_before.view(-1).clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want_cache[s], want_scale[s] = quantize_row_by_hand(k[t], scale_fmt)
    assert_same(k_cache.view(-1, D), want_cache)
    assert_same(k_scale.view(-1), want_scale)
    if scale_fmt == "ue8m0":
        mantissa, _ = torch.frexp(k_scale.view(-1)[[31, 2, 17, 8]])
        assert bool((mantissa == 0.5).all())  # powers of two
    # dequantized keys are within FP8 (e4m3) precision of the originals
    written = torch.tensor([31, 2, 17], dtype=torch.long)
    deq = k_cache.view(-1, D)[written].float() * k_scale.view(-1)[written, None]
    torch.testing.assert_close(deq, k[[0, 2, 3]].float(), rtol=0.125, atol=float(k.float().abs().max()) / 448 * 2)


@pytest.mark.parametrize("slots,expected", [
    ([0, 32], "values in [0, 32) (or -1)"),
    ([-5, 1], "values in [0, 32) (or -1)"),
    ([6, 6], "slot 6 more than once"),
])
def test_indexer_k_cache_write_bad_slots_raise_before_any_write(slots, expected):
    g = gen(6)
    k_cache = random_rows(32, 16, FP8, g).view(4, 8, 16)
    k_scale = torch.rand(4, 8, generator=g)
    before = (k_cache.clone(), k_scale.clone())
    with pytest.raises(hal.InvalidInputError) as info:
        hal.ops.indexer_k_cache_write(random_rows(2, 16, torch.bfloat16, g), k_cache, k_scale,
                                      torch.tensor(slots, dtype=torch.int32), None)
    assert info.value.arg == "slot_mapping" and expected in str(info.value)
    assert_same(k_cache, before[0])
    assert_same(k_scale, before[1])


# -- kv_cache_gather ------------------------------------------------------------------------------
def paged_batch(lens, block_size, D, dtype, g, spare_blocks=3, pad=-1):
    """Scatters random sequences over a shuffled block pool. Returns (cache, block_table,
    context_lens, sequences) with unused block-table entries set to `pad`."""
    blocks_per_seq = [-(-n // block_size) for n in lens]
    max_blocks = max(blocks_per_seq, default=0) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=g).tolist()
    cache = random_rows(num_blocks * block_size, D, dtype, g).view(num_blocks, block_size, D)
    table = torch.full((len(lens), max_blocks), pad, dtype=torch.int32)
    sequences = []
    for b, n in enumerate(lens):
        seq = random_rows(n, D, dtype, g)
        for p in range(n):
            if p % block_size == 0:
                table[b, p // block_size] = pool.pop()
            cache[table[b, p // block_size], p % block_size] = seq[p]
        sequences.append(seq)
    return cache, table, torch.tensor(lens, dtype=torch.int32), sequences


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("lens,block_size", [
    ([5, 0, 17, 16], 4),      # empty sequence, exact block fill
    ([1], 1),
    ([33, 64, 2], 16),
    ([], 8),                  # empty batch
    ([0, 0], 4),
])
def test_kv_cache_gather_equals_contiguous_sequences(dtype, lens, block_size):
    g = gen(sum(lens) + block_size)
    cache, table, context_lens, sequences = paged_batch(lens, block_size, 12, dtype, g)
    out = hal.ops.kv_cache_gather(cache, table, context_lens)
    assert_same(out, torch.cat(sequences) if sequences else torch.empty(0, 12, dtype=dtype))


def test_kv_cache_gather_ignores_entries_past_the_used_blocks():
    g = gen(7)
    cache, table, lens, sequences = paged_batch([6, 3], 4, 5, torch.float32, g, pad=987654)
    table[1, 1:] = -7  # garbage past sequence 1's single block
    assert_same(hal.ops.kv_cache_gather(cache, table, lens), torch.cat(sequences))


def test_kv_cache_gather_maximum_block_table_fill():
    g = gen(8)
    cache, table, lens, sequences = paged_batch([8, 3], 4, 5, torch.float32, g)
    table = table[:, :2].contiguous()  # sequence 0 now fills its whole row
    assert_same(hal.ops.kv_cache_gather(cache, table, lens), torch.cat(sequences))


@pytest.mark.parametrize("lens,table,arg,expected", [
    ([9, 1], [[0, 1], [2, -1]], "context_lens", "values in [0, 9)"),
    ([-1, 1], [[0, 1], [2, -1]], "context_lens", "values in [0, 9)"),
    ([5, 1], [[0, -1], [2, -1]], "block_table", "-1 at [0, 1]"),
    ([5, 1], [[0, 1], [6, -1]], "block_table", "6 at [1, 0]"),
])
def test_kv_cache_gather_bad_values(lens, table, arg, expected):
    cache = torch.zeros(6, 4, 3)
    with pytest.raises(hal.InvalidInputError) as info:
        hal.ops.kv_cache_gather(cache, torch.tensor(table, dtype=torch.int32),
                                torch.tensor(lens, dtype=torch.int32))
    assert info.value.op == "kv_cache_gather" and info.value.arg == arg
    assert expected in str(info.value)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_kv_cache_gather_refuses_blocks_of_no_rows(backend):
    # position p lives in block p // block_size: a cache of empty blocks has no positions
    with hal.use(backend):
        assert_invalid(hal.ops.kv_cache_gather, (torch.zeros(4, 0, 8), torch.zeros(1, 2, dtype=torch.int32),
                                                 torch.tensor([0], dtype=torch.int32)),
                       "kv_cache_gather", "cache", "block_size >= 1")


# -- the input contract (metadata) --------------------------------------------------------------------
def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


BAD = [
    ("kv_cache_write", (torch.zeros(2, 4, 8).int(), torch.zeros(1, 8).int(), i32(0)), "cache", "dtype"),
    ("kv_cache_write", (torch.zeros(8, 8), torch.zeros(1, 8), i32(0)), "cache", "a 3-d tensor"),
    ("kv_cache_write", (torch.zeros(2, 8, 4).transpose(1, 2), torch.zeros(1, 8), i32(0)), "cache",
     "a paged layout"),
    ("kv_cache_write", (torch.zeros(4, 8).expand(2, 4, 8), torch.zeros(1, 8), i32(0)), "cache",
     "a paged layout"),
    ("kv_cache_write", (torch.zeros(2, 4, 8), torch.zeros(1, 8).bfloat16(), i32(0)), "values",
     "dtype float32 (the dtype of 'cache')"),
    ("kv_cache_write", (torch.zeros(2, 4, 8), torch.zeros(1, 7), i32(0)), "values", "got shape [1, 7]"),
    ("kv_cache_write", (torch.zeros(2, 4, 8), torch.zeros(2, 8), i32(0)), "slot_mapping", "got shape [1]"),
    ("kv_cache_write", (torch.zeros(2, 4, 8), torch.zeros(1, 8), torch.zeros(1)), "slot_mapping",
     "dtype int32 or int64"),
    ("kv_cache_write", (torch.zeros(2, 4, 8), torch.zeros(1, 8, device="meta"), i32(0)), "values",
     "a tensor on cpu"),
    ("indexer_k_cache_write", (torch.zeros(1, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4), i32(0), None),
     "k_cache", "dtype float8_e4m3fn"),
    ("indexer_k_cache_write", (torch.zeros(1, 8), torch.zeros(2, 4, 7).to(FP8), torch.zeros(2, 4), i32(0), None),
     "k_cache", "got shape [2, 4, 7]"),
    ("indexer_k_cache_write", (torch.zeros(1, 8), torch.zeros(2, 4, 8).to(FP8), torch.zeros(2, 5), i32(0), None),
     "k_scale", "got shape [2, 5]"),
    ("indexer_k_cache_write", (torch.zeros(1, 8), torch.zeros(2, 4, 8).to(FP8), torch.zeros(2, 4).half(),
                               i32(0), None), "k_scale", "dtype float32"),
    ("indexer_k_cache_write", (torch.zeros(1, 8), torch.zeros(2, 4, 8).to(FP8), torch.zeros(2, 4), i32(0), "e8m0"),
     "scale_fmt", "one of [None, 'ue8m0']"),
    ("indexer_k_cache_write", (torch.zeros(1, 8).int(), torch.zeros(2, 4, 8).to(FP8), torch.zeros(2, 4), i32(0),
                               None), "k", "dtype float32"),
    ("indexer_k_cache_write", (torch.zeros(1, 0), torch.zeros(2, 4, 0).to(FP8), torch.zeros(2, 4), i32(0), None),
     "k", "D >= 1"),
    ("kv_cache_gather", (torch.zeros(2, 4, 8), torch.zeros(1, 2, dtype=torch.int64), i32(3)), "block_table",
     "dtype int32"),
    ("kv_cache_gather", (torch.zeros(2, 4, 8), torch.zeros(1, 2, dtype=torch.int32), i32(3, 1)), "context_lens",
     "got shape [2]"),
    ("kv_cache_gather", (torch.zeros(2, 4, 8), torch.zeros(2, dtype=torch.int32), i32(3)), "block_table",
     "a 2-d tensor"),
    ("kv_cache_gather", (torch.zeros(8, 8), torch.zeros(1, 2, dtype=torch.int32), i32(3)), "cache",
     "a 3-d tensor"),
]


@pytest.mark.parametrize("op,args,arg,expected", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_invalid_input_error(op, args, arg, expected):
    assert_invalid(getattr(hal.ops, op), args, op, arg, expected)


# -- torch integration ------------------------------------------------------------------------------
def sample_args(name):
    g = gen(9)
    if name == "kv_cache_write":
        return (torch.randn(3, 4, 8, generator=g), torch.randn(4, 8, generator=g), i32(5, -1, 0, 11))
    if name == "indexer_k_cache_write":
        return (torch.randn(3, 16, generator=g), torch.zeros(3, 4, 16).to(FP8), torch.zeros(3, 4),
                torch.tensor([5, -1, 11]), "ue8m0")
    cache, table, lens, _ = paged_batch([5, 0, 7], 4, 6, torch.float32, g)
    return cache, table, lens


OPS = ["kv_cache_write", "indexer_k_cache_write", "kv_cache_gather"]


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    op = hal.opdef.lookup(name).torch_op
    if name != "indexer_k_cache_write":
        torch.library.opcheck(op, sample_args(name))
        return
    # opcheck's test_schema compares mutated tensors with torch.allclose, which has no
    # float8 kernel on the CPU; test_mutating_schemas_declare_exactly_the_caches checks the
    # mutation declarations instead.
    torch.library.opcheck(op, sample_args(name), test_utils=(
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_mutating_schemas_declare_exactly_the_caches():
    for name, caches in (("kv_cache_write", {"cache"}), ("indexer_k_cache_write", {"k_cache", "k_scale"})):
        schema = hal.opdef.lookup(name).torch_op._schema
        assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == caches
        assert len(schema.returns) == 0


@pytest.mark.parametrize("name", OPS)
def test_compile_fullgraph(name):
    torch._dynamo.reset()
    fn = getattr(hal.ops, name)
    compiled_args, eager_args = sample_args(name), sample_args(name)
    got = torch.compile(fn, fullgraph=True)(*compiled_args)
    want = fn(*eager_args)
    if want is None:  # in-place: compare the mutated caches
        for a, b in zip(compiled_args, eager_args):
            if isinstance(a, torch.Tensor):
                assert_same(a, b)
    else:
        assert_same(got, want)


def test_compiled_write_then_gather_round_trip():
    torch._dynamo.reset()

    def step(cache, values, slots, table, lens):
        hal.ops.kv_cache_write(cache, values, slots)
        return hal.ops.kv_cache_gather(cache, table, lens) * 1

    cache = torch.zeros(4, 2, 3)
    values = torch.randn(3, 3, generator=gen(10))
    out = torch.compile(step, fullgraph=True)(cache, values, i32(6, 7, 2),
                                             torch.tensor([[3, 1]], dtype=torch.int32), i32(3))
    assert_same(out, values)


def test_docs_examples_run():
    text = (REPO / "docs" / "ops" / "kv.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4
    for block in blocks:
        exec(compile(block, "docs/ops/kv.md", "exec"), {})


# -- paged views: vLLM's indexer page (a block's FP8 rows, then its float32 scales) ---------------
def _vllm_indexer_pages(num_blocks, block_size, dim):
    """k_cache and k_scale as vLLM 0.32 lays out an indexer page: one uint8 buffer per block,
    block_size * dim FP8 values followed by block_size float32 scales."""
    pages = torch.zeros(num_blocks, block_size * (dim + 4), dtype=torch.uint8)
    values = pages[:, :block_size * dim].view(num_blocks, block_size, dim).view(FP8)
    scales = pages[:, block_size * dim:].view(torch.float32)
    return pages, values, scales


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_indexer_k_cache_write_into_interleaved_pages(backend):
    g = torch.Generator().manual_seed(3)
    nb, bs, dim = 4, 8, 128
    k = torch.randn(11, dim, generator=g) * torch.logspace(-2, 2, 11)[:, None]
    slots = torch.randperm(nb * bs, generator=g)[:11]
    pages, values, scales = _vllm_indexer_pages(nb, bs, dim)
    assert not values.is_contiguous() and not scales.is_contiguous()
    dense_values, dense_scales = torch.zeros(nb, bs, dim, dtype=FP8), torch.zeros(nb, bs)
    with hal.use(backend):
        hal.ops.indexer_k_cache_write(k, values, scales, slots, "ue8m0")
    with hal.use("reference"):
        hal.ops.indexer_k_cache_write(k, dense_values, dense_scales, slots, "ue8m0")
    assert torch.equal(values.view(torch.uint8), dense_values.view(torch.uint8))
    assert torch.equal(scales, dense_scales)
    # the paged read takes the same views in place
    q = torch.randn(2, 3, 4, dim, generator=g)
    weights = torch.rand(2, 3, 4, generator=g)
    table = torch.tensor([[2, 0, 3, 1], [1, 3, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([29, 12], dtype=torch.int32)
    with hal.use(backend):
        top = hal.ops.indexer_topk_paged(q, (values, scales), weights, table, lens, 5)
    with hal.use(backend):    # the same backend on contiguous copies: the views must not matter
        want = hal.ops.indexer_topk_paged(q, (dense_values, dense_scales), weights, table, lens, 5)
    assert torch.equal(top.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_kv_cache_write_into_block_strided_view(backend):
    g = torch.Generator().manual_seed(4)
    buffer = torch.zeros(3, 6, 9)
    cache = buffer[:, :4]                       # each block a page of 6 rows: 4 used
    values = torch.randn(5, 9, generator=g)
    slots = torch.tensor([11, 0, -1, 5, 7])
    with hal.use(backend):
        hal.ops.kv_cache_write(cache, values, slots)
    assert torch.equal(cache[2, 3], values[0]) and torch.equal(cache[0, 0], values[1])
    assert torch.equal(cache[1, 1], values[3]) and torch.equal(cache[1, 3], values[4])
    assert buffer[:, 4:].abs().sum() == 0        # the rows between pages are never written


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_overlapping_key_and_scale_pages_are_rejected_before_writing(backend):
    pages, values, _ = _vllm_indexer_pages(2, 4, 16)
    overlapping = pages[:, :16].view(torch.float32)        # the scales over the first rows' bytes
    before = pages.clone()
    with hal.use(backend), pytest.raises(hal.InvalidInputError) as err:
        hal.ops.indexer_k_cache_write(torch.randn(2, 16), values, overlapping, torch.tensor([0, 5]))
    assert err.value.arg == "k_scale" and "overlapping" in str(err.value)
    assert torch.equal(pages, before)
