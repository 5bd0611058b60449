"""The cpu backend's native paged-KV ops against the reference: whole caches compared after
in-place writes (untouched slots included), bad slots and block ids raise InvalidInputError
from the native code itself with the cache untouched."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from glm5_hal import InvalidInputError, _C

from cpu_helpers import FLOATS, TIERS, chosen, cpu_impl, gen, isa_limit, native_view, tier  # noqa: F401

FP8 = torch.float8_e4m3fn
CACHE_DTYPES = (*FLOATS, FP8)


def bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def random_cache(shape, dtype, g):
    return torch.randn(shape, generator=g).to(dtype)


def slot_mapping(tokens, num_slots, g, dtype=torch.int32, padding=0.25):
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    slots[torch.rand(tokens, generator=g) < padding] = -1
    return slots.to(dtype)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_kv_cache_write_matches_reference(dtype, slot_dtype):
    g = gen("kvw", str(dtype), str(slot_dtype))
    for blocks, block_size, dim, tokens in ((1, 1, 1, 1), (7, 16, 576, 50), (3, 5, 33, 15), (4, 8, 8, 0)):
        cache = random_cache((blocks, block_size, dim), dtype, g)
        values = random_cache((tokens, dim), dtype, g)
        slots = slot_mapping(tokens, blocks * block_size, g, slot_dtype)
        want = cache.clone()
        hal.reference.kv_cache_write(want, values, slots)
        assert chosen("kv_cache_write", cache, values, slots) == "cpu.kv_cache_write"
        hal.ops.kv_cache_write(cache, values, slots)
        assert torch.equal(bits(cache), bits(want))


def test_kv_cache_write_strided_values():
    g = gen("kvw-strided")
    cache = torch.zeros(2, 4, 8)
    wide = torch.randn(5, 16, generator=g)
    slots = torch.tensor([7, -1, 0, 3, 4], dtype=torch.int64)
    for values in (wide[:, :8], wide[:, ::2], torch.randn(8, 5, generator=g).t()):
        want = cache.clone()
        hal.reference.kv_cache_write(want, values, slots)
        hal.ops.kv_cache_write(cache, values, slots)
        assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_indexer_k_cache_write_bit_exact(tier, dtype, scale_fmt):
    g = gen("ikw", str(dtype), scale_fmt, tier)
    for blocks, block_size, dim, tokens in ((5, 16, 128, 40), (2, 3, 1, 4), (3, 4, 17, 9)):
        k = (torch.randn(tokens, dim, generator=g) * 4).to(dtype)
        k[0] = 0                                               # amax below 1e-4: the floor
        kc = torch.randn(blocks, block_size, dim, generator=g).to(FP8)
        ks = torch.rand(blocks, block_size, generator=g)
        slots = slot_mapping(tokens, blocks * block_size, g, padding=0.2)
        wc, ws = kc.clone(), ks.clone()
        hal.reference.indexer_k_cache_write(k, wc, ws, slots, scale_fmt)
        assert chosen("indexer_k_cache_write", k, kc, ks, slots, scale_fmt) == "cpu.indexer_k_cache_write"
        hal.ops.indexer_k_cache_write(k, kc, ks, slots, scale_fmt)
        assert torch.equal(bits(kc), bits(wc)) and torch.equal(ks, ws)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_kv_cache_gather_matches_reference(dtype):
    g = gen("gather", str(dtype))
    cache = random_cache((12, 16, 72), dtype, g)
    table = torch.randperm(12, generator=g)[:10].view(2, 5).to(torch.int32)
    table[1, 4] = -1                                          # padding past the blocks in use
    for lens in ([80, 64], [0, 5], [1, 0], [17, 33]):
        cl = torch.tensor(lens, dtype=torch.int32)
        assert chosen("kv_cache_gather", cache, table, cl) == "cpu.kv_cache_gather"
        assert torch.equal(bits(hal.ops.kv_cache_gather(cache, table, cl)),
                           bits(hal.reference.kv_cache_gather(cache, table, cl)))
    empty = hal.ops.kv_cache_gather(cache, torch.zeros(0, 5, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (0, 72)
    # a non-contiguous cache and a strided block table
    nc = random_cache((16, 12, 72), dtype, g).transpose(0, 1)
    wide = torch.randint(0, 12, (2, 10), generator=g, dtype=torch.int32)[:, ::2]
    cl = torch.tensor([70, 3], dtype=torch.int32)
    assert torch.equal(bits(hal.ops.kv_cache_gather(nc, wide, cl)), bits(hal.reference.kv_cache_gather(nc, wide, cl)))


def test_native_kv_write_rejects_bad_slots_before_writing():
    cache = torch.zeros(2, 4, 8)
    values = torch.ones(3, 8)
    for bad in ([0, 8, 1], [0, -2, 1], [3, 3, -1], [-1, 2**31 - 1, 0]):
        for sdt in (torch.int32, torch.int64):
            slots = torch.tensor(bad, dtype=sdt)
            with pytest.raises(InvalidInputError, match="slot_mapping"):
                _C.kv_cache_write(cache, values, slots, 1)
            with pytest.raises(InvalidInputError):
                cpu_impl("kv_cache_write")(cache, values, slots)
            assert (cache == 0).all()
    ok = torch.tensor([0, 1, 2], dtype=torch.int32)
    for args in [(cache, values, native_view(ok, dtype=0)),                   # float code as slot dtype
                 (native_view(cache, size=(2, 4, -1)), values, ok),            # row size < 0
                 (cache, native_view(values, stride=(-8, 1)), ok),             # stride < 0
                 (native_view(cache, size=(1, 2, 8)), values, ok),             # fewer slots than used
                 (cache, native_view(values, size=(-1, 8)), ok)]:              # T < 0
        with pytest.raises(InvalidInputError):
            _C.kv_cache_write(*args, 1)
        assert (cache == 0).all()


def test_native_indexer_write_rejects_bad_slots_before_writing():
    k = torch.randn(2, 16)
    kc = torch.zeros(2, 2, 16, dtype=FP8)
    ks = torch.zeros(2, 2)
    for bad in ([4, 0], [1, 1], [-5, 0]):
        slots = torch.tensor(bad, dtype=torch.int64)
        with pytest.raises(InvalidInputError, match="slot_mapping"):
            cpu_impl("indexer_k_cache_write")(k, kc, ks, slots, None)
        assert (kc.view(torch.uint8) == 0).all() and (ks == 0).all()
    ok = torch.tensor([0, 1], dtype=torch.int32)
    # D = 0, stride < 0, int dtype
    for bad_k in [native_view(k, size=(2, 0)), native_view(k, stride=(-1, 1)), native_view(k, dtype=4)]:
        with pytest.raises(InvalidInputError):
            _C.indexer_k_cache_write(bad_k, kc, ks, ok, False, 1)
    assert (kc.view(torch.uint8) == 0).all() and (ks == 0).all()


def test_native_gather_rejects_bad_tables_and_lengths():
    cache = torch.randn(4, 4, 8)
    out = torch.full((8, 8), 3.0)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cases = [([[0, 4], [2, 3]], [8, 0], "block_table"),     # block id >= num_blocks, in use
             ([[0, -1], [2, 3]], [5, 3], "block_table"),    # -1 in use
             ([[0, 1], [2, 3]], [9, 0], "context_lens"),    # longer than the table holds
             ([[0, 1], [2, 3]], [-1, 0], "context_lens")]
    for rows, lens, arg in cases:
        t = torch.tensor(rows, dtype=torch.int32)
        cl = torch.tensor(lens, dtype=torch.int32)
        with pytest.raises(InvalidInputError, match=arg):
            cpu_impl("kv_cache_gather")(cache, t, cl)
        with pytest.raises(InvalidInputError, match=arg):
            _C.kv_cache_gather(native_view(out, size=(max(sum(lens), 0), 8)), cache, t, cl, 1)
        assert (out == 3.0).all()
    cl = torch.tensor([4, 4], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="out"):    # output rows disagree with the lengths
        _C.kv_cache_gather(native_view(out, size=(7, 8)), cache, table, cl, 1)
    with pytest.raises(InvalidInputError):
        _C.kv_cache_gather(out, cache, native_view(table, stride=(-2, 1)), cl, 1)
    assert (out == 3.0).all()
    # -1 past the blocks in use is padding, not an error
    t = torch.tensor([[1, -1], [3, -1]], dtype=torch.int32)
    cl = torch.tensor([4, 2], dtype=torch.int32)
    assert torch.equal(cpu_impl("kv_cache_gather")(cache, t, cl), hal.reference.kv_cache_gather(cache, t, cl))


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 6), block_size=st.integers(1, 9), dim=st.integers(1, 70), tokens=st.integers(0, 12),
       dtype=st.sampled_from(CACHE_DTYPES), seed=st.integers(0, 2**31 - 1), tier_=st.sampled_from(TIERS),
       corrupt=st.sampled_from([None, "high", "low", "dup"]))
def test_property_kv_ops(blocks, block_size, dim, tokens, dtype, seed, tier_, corrupt):
    g = torch.Generator().manual_seed(seed)
    num_slots = blocks * block_size
    tokens = min(tokens, num_slots)
    cache = random_cache((blocks, block_size, dim), dtype, g)
    values = random_cache((tokens, dim), dtype, g)
    slots = slot_mapping(tokens, num_slots, g)
    if corrupt and tokens:
        i = int(torch.randint(0, tokens, (1,), generator=g))
        if corrupt == "high":
            slots[i] = num_slots + int(torch.randint(0, 3, (1,), generator=g))
        elif corrupt == "low":
            slots[i] = -2 - int(torch.randint(0, 3, (1,), generator=g))
        elif tokens >= 2:
            slots[i], slots[(i + 1) % tokens] = 0, 0
        else:
            corrupt = None
    elif corrupt:
        corrupt = None
    before = cache.clone()
    with isa_limit(tier_):
        if corrupt:
            with pytest.raises(InvalidInputError):
                cpu_impl("kv_cache_write")(cache, values, slots)
            assert torch.equal(bits(cache), bits(before))
            return
        want = cache.clone()
        hal.reference.kv_cache_write(want, values, slots)
        cpu_impl("kv_cache_write")(cache, values, slots)
        assert torch.equal(bits(cache), bits(want))
        max_blocks = blocks
        table = torch.stack([torch.randperm(blocks, generator=g) for _ in range(2)]).to(torch.int32)
        lens = torch.randint(0, max_blocks * block_size + 1, (2,), generator=g, dtype=torch.int32)
        assert torch.equal(bits(cpu_impl("kv_cache_gather")(cache, table, lens)),
                           bits(hal.reference.kv_cache_gather(cache, table, lens)))
        if dtype != FP8:
            kc = torch.zeros(blocks, block_size, dim, dtype=FP8)
            ks = torch.zeros(blocks, block_size)
            wc, ws = kc.clone(), ks.clone()
            hal.reference.indexer_k_cache_write(values, wc, ws, slots, "ue8m0")
            cpu_impl("indexer_k_cache_write")(values, kc, ks, slots, "ue8m0")
            assert torch.equal(bits(kc), bits(wc)) and torch.equal(ks, ws)
