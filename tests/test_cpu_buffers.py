"""The cpu backend's cache of large output buffers (backends/cpu/buffers.py): never lends memory
a live tensor (or anything else) still uses, stays within its bound, frees on request and
under memory pressure, and the ops built on it give the same results when their memory is
reused."""
from __future__ import annotations

import gc
import os
import threading
import weakref

import numpy as np
import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends import cpu as cpu_backend
from glm5_hal.backends.cpu import buffers
from glm5_hal.backends.cpu.buffers import OutputCache, size_class
from glm5_hal.errors import PluginError

MIB = 1 << 20
SHAPE = (512, 1024)   # 2 MiB of float32: above the test caches' 1 MiB threshold


def cache(capacity=64 * MIB, **kw) -> OutputCache:
    return OutputCache(capacity, min_bytes=MIB, available=lambda: None, **kw)


def span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a1 <= b0 or b1 <= a0


def test_a_dropped_output_is_reused_and_a_live_one_is_not():
    c = cache()
    a = c.empty(SHAPE, torch.float32)
    b = c.empty(SHAPE, torch.float32)   # a is alive: b must not overlap it
    assert disjoint(a, b)
    assert c.stats()["misses"] == 2
    a_ptr = a.data_ptr()
    del a
    again = c.empty(SHAPE, torch.float32)
    assert again.data_ptr() == a_ptr and c.stats()["hits"] == 1
    assert disjoint(again, b)


def test_outputs_are_plain_contiguous_tensors_of_the_asked_shape_and_dtype():
    c = cache()
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn):
        t = c.empty((3, 700, 1000), dtype)
        assert t.shape == (3, 700, 1000) and t.dtype == dtype and t.is_contiguous()
        assert t._base is None and not t.requires_grad
        t.view(torch.uint8).fill_(7)   # writable over its whole extent
        assert t.untyped_storage().nbytes() >= t.nbytes


# Each of these keeps the memory of `out` in use after the tensor `out` itself is gone.
HOLDERS = {
    "a view": lambda out: out[1:],
    "a reshaped view": lambda out: out.view(-1),
    "a numpy array": lambda out: out.numpy(),
    "the storage object": lambda out: out.untyped_storage(),
    "a DLPack capsule": lambda out: torch.utils.dlpack.to_dlpack(out),
    "a tensor set_ on its storage": lambda out: torch.empty(0).set_(out.untyped_storage()),
    "a graph that saved it for backward": lambda out: torch.ones(SHAPE, requires_grad=True) * out,
    "a list": lambda out: [out],
}


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_memory_held_through_anything_is_not_lent_again(holder):
    c = cache()
    out = c.empty(SHAPE, torch.float32)
    out.fill_(1.0)
    keep = HOLDERS[holder](out)
    first = span(out)
    del out
    other = c.empty(SHAPE, torch.float32)
    o0, o1 = span(other)
    assert o1 <= first[0] or first[1] <= o0, f"memory held by {holder} was lent again"
    other.fill_(2.0)
    del keep, other
    c.empty(SHAPE, torch.float32)   # everything dropped: the first block is idle again
    assert c.stats()["hits"] == 1


def test_many_overlapping_live_outputs_never_share_memory():
    c = cache(capacity=256 * MIB)
    live = []
    for i in range(24):
        shape = (256 + 64 * (i % 5), 1024)   # several sizes, some in the same size class
        t = c.empty(shape, torch.float32)
        t.fill_(float(i))
        live.append(t)
        if i % 3 == 2:
            live.pop(0)   # drop the oldest: its block may be lent again, but only it
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            assert disjoint(a, b)
    for t in live:   # nobody wrote into a live tensor
        assert (t == t.flatten()[0]).all()


def test_outputs_from_several_threads_never_overlap():
    c = cache(capacity=512 * MIB)
    live: list[torch.Tensor] = []
    lock = threading.Lock()

    def work(seed):
        for i in range(40):
            t = c.empty(SHAPE, torch.float32)
            t.fill_(seed * 100 + i)
            with lock:
                live.append(t)
                if len(live) > 6:
                    live.pop(0)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, a in enumerate(live):
        assert (a == a.flatten()[0]).all()
        for b in live[i + 1:]:
            assert disjoint(a, b)


def test_the_cache_stays_within_its_capacity():
    c = cache(capacity=10 * MIB)
    live = [c.empty(SHAPE, torch.float32) for _ in range(8)]   # 8 x 2 MiB, all alive
    assert c.stats()["held_bytes"] <= 10 * MIB
    for i, a in enumerate(live):   # those beyond the bound still came, just not from the cache
        for b in live[i + 1:]:
            assert disjoint(a, b)
    del live
    for _ in range(20):
        c.empty((1024, 1024 + 64 * (_ % 7)), torch.float32)
        assert c.stats()["held_bytes"] <= 10 * MIB
    big = c.empty((4096, 4096), torch.float32)   # 64 MiB: more than the capacity, never cached
    assert big.shape == (4096, 4096) and c.stats()["held_bytes"] <= 10 * MIB


def test_release_frees_idle_blocks_now_and_lent_ones_with_their_tensors():
    c = cache()
    idle = c.empty(SHAPE, torch.float32)
    lent = c.empty(SHAPE, torch.float32)
    idle_storage = weakref.ref(idle.untyped_storage())
    lent_storage = weakref.ref(lent.untyped_storage())
    del idle
    assert c.stats()["idle_bytes"] == size_class(2 * MIB)
    assert c.release() == size_class(2 * MIB)
    assert c.stats()["held_bytes"] == 0 and c.stats()["blocks"] == 0
    gc.collect()
    assert idle_storage() is None   # freed, not just forgotten
    assert lent_storage() is not None and (lent.fill_(3.0) == 3.0).all()
    del lent
    gc.collect()
    assert lent_storage() is None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc/self/statm")
def test_release_gives_the_memory_back_to_the_system():
    c = OutputCache(256 * MIB, min_bytes=MIB, available=lambda: None)
    out = c.empty((16 * MIB,), torch.float32)   # 64 MiB
    out.fill_(1.0)
    del out
    before = _rss_bytes()
    assert c.release() >= 64 * MIB
    gc.collect()
    assert before - _rss_bytes() >= 60 * MIB


def test_set_capacity_shrinks_and_zero_turns_the_cache_off():
    c = cache()
    a = c.empty(SHAPE, torch.float32)
    del a
    c.set_capacity(0)
    assert c.stats()["held_bytes"] == 0
    c.empty(SHAPE, torch.float32)
    assert c.stats()["blocks"] == 0
    with pytest.raises(ValueError, match="capacity"):
        c.set_capacity(-1)


def test_memory_pressure_stops_growth_and_frees_idle_blocks():
    available = [1 << 40]
    c = OutputCache(64 * MIB, min_bytes=MIB, reserve=32 * MIB, available=lambda: available[0])
    a = c.empty(SHAPE, torch.float32)
    del a
    assert c.stats()["idle_bytes"] > 0
    available[0] = 16 * MIB   # below the reserve: do not grow, give back what is idle
    b = c.empty((1024, 1024), torch.float32)
    assert b.shape == (1024, 1024)
    s = c.stats()
    assert s["held_bytes"] == 0 and s["uncached"] == 1


def test_an_allocation_failure_frees_idle_blocks_and_falls_back_to_torch():
    def fail(nbytes):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    c = cache()
    a = c.empty(SHAPE, torch.float32)
    del a
    c._allocate = fail
    t = c.empty((1024, 1024), torch.float32)   # another size class: needs a new block
    assert t.shape == (1024, 1024) and c.stats()["held_bytes"] == 0


def test_a_lent_storage_moved_by_the_caller_is_not_reused():
    c = cache()
    out = c.empty(SHAPE, torch.float32)
    out.share_memory_()   # the caller moved the storage to shared memory
    moved = out.data_ptr()
    del out
    again = c.empty(SHAPE, torch.float32)
    assert again.data_ptr() != moved and c.stats()["hits"] == 0


def test_size_classes_round_up_by_at_most_a_sixteenth_above_2_mib():
    for n in (1, MIB, 2 * MIB + 1, 33 * MIB, 100_663_296, 100_663_297, 3 * 10**9):
        k = size_class(n)
        assert k >= n and k % (2 * MIB) == 0
        assert k - n < max(2 * MIB, n / 16 * 2)


@pytest.mark.parametrize("text,error", [("lots", "whole number"), ("-5", ">= 0")])
def test_the_capacity_setting_is_validated(monkeypatch, text, error):
    monkeypatch.setenv("GLM5_HAL_CPU_OUTPUT_CACHE_MB", text)
    with pytest.raises(PluginError, match=error):
        buffers._default_capacity()
    monkeypatch.setenv("GLM5_HAL_CPU_OUTPUT_CACHE_MB", "64")
    assert buffers._default_capacity() == 64 * MIB


def test_the_huge_page_setting_is_validated(monkeypatch):
    with pytest.raises(PluginError, match="0 or 1"):
        monkeypatch.setenv("GLM5_HAL_CPU_HUGE_PAGES", "yes")
        buffers._env_flag("GLM5_HAL_CPU_HUGE_PAGES", True)
    monkeypatch.setenv("GLM5_HAL_CPU_HUGE_PAGES", "0")
    assert buffers._env_flag("GLM5_HAL_CPU_HUGE_PAGES", True) is False


# -- the ops on reused memory -----------------------------------------------------------------
def _moe_inputs(seed, tokens=64, hidden=2048, experts=16, k=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    return x, ids, experts


def test_moe_ops_take_their_large_outputs_from_the_cache_and_stay_exact_on_reused_memory():
    cpu_backend.release_cached_outputs()
    with hal.use("cpu"):
        x, ids, e = _moe_inputs(0)                   # x_perm: 256 x 2048 bf16 = 1 MiB
        first = hal.ops.moe_permute(x, ids, e)[0]
        first.fill_(float("nan"))                    # garbage left in the block for the next call
        first_ptr = first.data_ptr()
        del first
        hits = cpu_backend.cached_output_stats()["hits"]
        x2, ids2, _ = _moe_inputs(1)
        got = hal.ops.moe_permute(x2, ids2, e)
        assert cpu_backend.cached_output_stats()["hits"] == hits + 1 and got[0].data_ptr() == first_ptr
        want = hal.reference.moe_permute(x2, ids2, e)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=0, atol=0)
        kept = got[0].clone()
        y = got[0]
        weights = torch.rand(ids2.shape, generator=torch.Generator().manual_seed(2))
        out = hal.ops.moe_unpermute(y, got[2], weights)   # [64, 2048]: small, from torch
        torch.testing.assert_close(out, hal.reference.moe_unpermute(y, got[2], weights))
        again = hal.ops.moe_permute(x, ids, e)[0]    # y still alive: must not reuse its memory
        assert disjoint(again, y) and torch.equal(y, kept)


def test_bf16_grouped_gemm_is_exact_on_reused_memory():
    g = torch.Generator().manual_seed(3)
    experts, rows, n, k = 4, 512, 1024, 64   # out: 512 x 1024 bf16 = 1 MiB
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(experts, n, k, generator=g).to(torch.bfloat16)
    counts = torch.tensor([100, 0, 300, 112], dtype=torch.int32)
    with hal.use("cpu"):
        first = hal.ops.grouped_gemm(x, w, counts)
        first.fill_(float("nan"))
        del first
        got = hal.ops.grouped_gemm(x, w, counts)
        kept = got.clone()
        other = hal.ops.grouped_gemm(x, w.flip(0), counts)
    assert not torch.isnan(got).any() and disjoint(got, other) and torch.equal(got, kept)
    torch.testing.assert_close(got, hal.reference.grouped_gemm(x, w, counts), rtol=1.6e-2, atol=1e-2)


def test_the_backend_exposes_release_and_stats():
    with hal.use("cpu"):
        out = hal.ops.rms_norm(torch.randn(1024, 1024), torch.ones(1024), 1e-6)   # 4 MiB
    assert cpu_backend.cached_output_stats()["lent_bytes"] >= out.nbytes
    del out
    assert cpu_backend.release_cached_outputs() >= 4 * MIB
    assert cpu_backend.cached_output_stats()["held_bytes"] == 0


def test_outputs_beyond_the_capacity_are_fresh_mappings_with_the_huge_page_setting(monkeypatch):
    mapped = []
    real = buffers.map_block
    monkeypatch.setattr(buffers, "map_block", lambda n, huge: mapped.append((n, huge)) or real(n, huge))
    c = OutputCache(0, min_bytes=MIB, huge_pages=True, available=lambda: None)   # the cache off
    big = c.empty((8 * MIB,), torch.float32)     # 32 MiB: glibc would map it fresh too
    assert mapped == [(32 * MIB, True)] and big.shape == (8 * MIB,) and c.stats()["held_bytes"] == 0
    big.fill_(1.0)
    small = c.empty((MIB,), torch.float32)       # 4 MiB: torch's (glibc's heap may reuse it)
    assert len(mapped) == 1 and disjoint(big, small)
    short = OutputCache(0, min_bytes=MIB, huge_pages=True, reserve=64 * MIB, available=lambda: 48 * MIB)
    short.empty((8 * MIB,), torch.float32)       # memory short: no huge-page request
    off = OutputCache(0, min_bytes=MIB, huge_pages=False, available=lambda: None)
    off.empty((8 * MIB,), torch.float32)
    assert len(mapped) == 1
