"""glm5_hal.kv: the reference-counted BlockAllocator (a stateful hypothesis model) and
PagedKVCache end to end with the kv ops (writes through its slot mappings, gathers through
its block tables equal the contiguous sequences)."""
from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import glm5_hal as hal
from glm5_hal.kv import BlockAllocator, OutOfBlocksError, PagedKVCache


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- BlockAllocator ---------------------------------------------------------------------------------
def snapshot(alloc: BlockAllocator) -> tuple:
    return alloc.num_free, tuple(alloc.refcount(b) for b in range(alloc.num_blocks))


class AllocatorModel(RuleBasedStateMachine):
    """The allocator against a plain multiset of held references."""

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(12)
        self.refs: collections.Counter = collections.Counter()  # block -> references held

    def held(self) -> list[int]:
        return sorted(self.refs.elements())

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        before = snapshot(self.alloc)
        if n > 12 - len(self.refs):
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate(n)
            assert snapshot(self.alloc) == before
            return
        blocks = self.alloc.allocate(n)
        assert len(blocks) == len(set(blocks)) == n
        for b in blocks:
            assert self.refs[b] == 0, f"block {b} handed out while held"
            self.refs[b] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.refs)), max_size=4))
        self.alloc.share(blocks)
        self.refs.update(blocks)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        held = self.held()
        picked = data.draw(st.lists(st.integers(0, len(held) - 1), unique=True, max_size=len(held)))
        blocks = [held[i] for i in picked]
        released = self.alloc.free(blocks)
        self.refs.subtract(blocks)
        gone = {b for b, c in self.refs.items() if c == 0}
        assert sorted(released) == sorted(gone)
        for b in gone:
            del self.refs[b]

    @rule(block=st.integers(0, 11), extra=st.integers(1, 2))
    def over_free_is_rejected(self, block, extra):
        before = snapshot(self.alloc)
        with pytest.raises(hal.InvalidInputError):
            self.alloc.free([block] * (self.refs[block] + extra))
        assert snapshot(self.alloc) == before

    @rule(block=st.integers(0, 11))
    def sharing_a_free_block_is_rejected(self, block):
        if self.refs[block]:
            return
        before = snapshot(self.alloc)
        with pytest.raises(hal.InvalidInputError):
            self.alloc.share([block])
        assert snapshot(self.alloc) == before

    @invariant()
    def matches_model(self):
        assert self.alloc.num_free == 12 - len(self.refs)
        for b in range(12):
            count = self.alloc.refcount(b)
            assert count >= 0 and count == self.refs[b]


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_allocator_exhaustion_error_is_clear_and_changes_nothing():
    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    assert first == [0, 1, 2]
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks, only 1 of 4 are free") as info:
        alloc.allocate(2)
    assert isinstance(info.value, hal.HalError)
    assert alloc.num_free == 1 and alloc.allocate(1) == [3]
    assert alloc.allocate(0) == []


def test_allocator_reference_counts_keep_shared_blocks_alive():
    alloc = BlockAllocator(3)
    a = alloc.allocate(2)
    alloc.share(a)
    assert alloc.free(a) == [] and alloc.num_free == 1
    assert alloc.free([a[0]]) == [a[0]] and alloc.num_free == 2
    with pytest.raises(hal.InvalidInputError, match="listed 1x with 0 references"):
        alloc.free([a[0]])


@pytest.mark.parametrize("call,arg", [
    (lambda a: a.free([7]), "blocks"),
    (lambda a: a.free([-1]), "blocks"),
    (lambda a: a.share([1.0]), "blocks"),
    (lambda a: a.allocate(-1), "n"),
    (lambda a: a.refcount(4), "block"),
    (lambda a: BlockAllocator(-2), "num_blocks"),
])
def test_allocator_bad_arguments(call, arg):
    with pytest.raises(hal.InvalidInputError) as info:
        call(BlockAllocator(4))
    assert info.value.arg == arg


# -- PagedKVCache ---------------------------------------------------------------------------------
def write(cache: PagedKVCache, seq, rows: torch.Tensor, contents: dict) -> None:
    slots = cache.append(seq, rows.shape[0])
    assert slots.dtype == torch.int32 and slots.shape == (rows.shape[0],)
    hal.ops.kv_cache_write(cache.tensor, rows, slots)
    contents.setdefault(seq, []).append(rows)


def assert_gather_matches(cache: PagedKVCache, seqs, contents: dict) -> None:
    table, lens = cache.block_table(seqs), cache.context_lens(seqs)
    assert table.dtype == lens.dtype == torch.int32 and table.shape[0] == lens.shape[0] == len(seqs)
    got = hal.ops.kv_cache_gather(cache.tensor, table, lens)
    want = [torch.cat(contents[s]) for s in seqs if contents.get(s)]
    torch.testing.assert_close(got, torch.cat(want) if want else cache.tensor.new_empty(0, cache.tensor.shape[2]),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_cache_end_to_end_with_interleaved_appends(dtype):
    g = gen(1)
    cache = PagedKVCache(num_blocks=20, block_size=4, dim=6, dtype=dtype)
    contents: dict = {}
    chunks = [("a", 3), ("b", 9), ("a", 1), ("c", 0), ("a", 5), ("b", 4), ("c", 2), ("a", 4)]
    for seq, n in chunks:
        write(cache, seq, torch.randn(n, 6, generator=g).to(dtype), contents)
    assert cache.context_lens(["a", "b", "c"]).tolist() == [13, 13, 2]
    table = cache.block_table(["a", "b", "c"])
    assert table.shape == (3, 4)
    assert table[2].tolist()[1:] == [-1, -1, -1]  # padded
    used = [b for b in table.flatten().tolist() if b >= 0]
    assert len(used) == len(set(used)) == 4 + 4 + 1 and cache.allocator.num_free == 20 - 9
    assert_gather_matches(cache, ["a", "b", "c"], contents)
    assert_gather_matches(cache, ["c", "a"], contents)
    cache.free("b")
    assert "b" not in cache and cache.allocator.num_free == 20 - 5
    assert_gather_matches(cache, ["a", "c"], contents)
    cache.free("a")
    cache.free("c")
    assert cache.allocator.num_free == 20


def test_paged_cache_fork_shares_full_blocks_only():
    g = gen(2)
    cache = PagedKVCache(num_blocks=10, block_size=4, dim=3, dtype=torch.float32)
    contents: dict = {}
    write(cache, "parent", torch.randn(10, 3, generator=g), contents)       # 2 full blocks + 2 tokens
    parent_blocks = cache.block_table(["parent"])[0].tolist()
    assert cache.fork("parent", "child") == 8
    child_blocks = cache.block_table(["child"])[0].tolist()
    assert child_blocks == parent_blocks[:2]
    assert [cache.allocator.refcount(b) for b in parent_blocks] == [2, 2, 1]
    # the child re-writes the tokens of the parent's partial block, then goes its own way
    prefix = torch.cat(contents["parent"])
    contents["child"] = [prefix[:8]]
    write(cache, "child", prefix[8:], contents)
    write(cache, "child", torch.randn(3, 3, generator=g), contents)
    write(cache, "parent", torch.randn(5, 3, generator=g), contents)
    assert set(cache.block_table(["child"])[0].tolist()[2:]).isdisjoint(parent_blocks)
    assert_gather_matches(cache, ["parent", "child"], contents)
    cache.free("parent")
    assert [cache.allocator.refcount(b) for b in parent_blocks[:2]] == [1, 1]
    assert_gather_matches(cache, ["child"], contents)
    cache.free("child")
    assert cache.allocator.num_free == 10


def test_paged_cache_fork_at_a_block_boundary_shares_everything():
    cache = PagedKVCache(num_blocks=4, block_size=2, dim=1, dtype=torch.float32)
    cache.append("p", 4)
    assert cache.fork("p", "c") == 4 and cache.allocator.num_free == 2
    assert cache.block_table(["c"]).tolist() == cache.block_table(["p"]).tolist()


def test_paged_cache_out_of_blocks_changes_nothing():
    cache = PagedKVCache(num_blocks=3, block_size=4, dim=2, dtype=torch.float32)
    cache.append("a", 6)
    before = (cache.block_table(["a"]).tolist(), cache.context_lens(["a"]).tolist(), cache.allocator.num_free)
    with pytest.raises(OutOfBlocksError):
        cache.append("a", 7)  # needs 2 more blocks, 1 is free
    with pytest.raises(OutOfBlocksError):
        cache.append("new", 5)
    assert "new" not in cache
    assert (cache.block_table(["a"]).tolist(), cache.context_lens(["a"]).tolist(),
            cache.allocator.num_free) == before
    assert cache.append("a", 6).tolist() == [6, 7, 8, 9, 10, 11]  # the next block is 2


def test_paged_cache_block_table_width_and_errors():
    cache = PagedKVCache(num_blocks=6, block_size=2, dim=1, dtype=torch.float32)
    cache.append(0, 3)
    cache.append(1, 0)
    assert cache.block_table([0, 1], width=4).tolist() == [[0, 1, -1, -1], [-1, -1, -1, -1]]
    assert cache.block_table([1]).shape == (1, 0)
    assert cache.block_table([]).shape == (0, 0)
    for call, arg in [(lambda: cache.block_table([0], width=1), "width"),
                      (lambda: cache.context_lens([0, 7]), "seq_ids"),
                      (lambda: cache.free(7), "seq_id"),
                      (lambda: cache.fork(7, 8), "parent"),
                      (lambda: cache.fork(0, 1), "child"),
                      (lambda: cache.append(0, -1), "n"),
                      (lambda: PagedKVCache(4, 0, 8), "block_size")]:
        with pytest.raises(hal.InvalidInputError) as info:
            call()
        assert info.value.arg == arg


def test_paged_cache_new_cache_serves_the_indexer_key_cache():
    g = gen(3)
    cache = PagedKVCache(num_blocks=5, block_size=4, dim=576)
    assert cache.tensor.shape == (5, 4, 576) and cache.tensor.dtype == torch.bfloat16
    k_cache, k_scale = cache.new_cache(128, dtype=torch.float8_e4m3fn), cache.new_cache(dtype=torch.float32)
    assert k_cache.shape == (5, 4, 128) and k_scale.shape == (5, 4)
    k = torch.randn(7, 128, generator=g)
    hal.ops.indexer_k_cache_write(k, k_cache, k_scale, cache.append("s", 7), None)
    table, lens = cache.block_table(["s"]), cache.context_lens(["s"])
    deq = hal.ops.kv_cache_gather(k_cache, table, lens).float() * \
        hal.ops.kv_cache_gather(k_scale.unsqueeze(-1), table, lens)
    torch.testing.assert_close(deq, k, rtol=0.125, atol=float(k.abs().max()) / 448 * 2)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "fork", "free"]), st.integers(0, 3),
                              st.integers(0, 3), st.integers(0, 9)), max_size=25),
       block_size=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_paged_cache_random_workload_keeps_sequences_intact(ops, block_size, seed):
    """Random appends, forks and frees: every gather equals the sequences as written, and
    freeing everything returns every block."""
    g = gen(seed)
    cache = PagedKVCache(num_blocks=16, block_size=block_size, dim=2, dtype=torch.float32)
    contents: dict = {}
    for kind, s, other, n in ops:
        if kind == "append":
            try:
                write(cache, s, torch.randn(n, 2, generator=g), contents)
            except OutOfBlocksError:
                assert cache.allocator.num_free < -(-n // block_size)
        elif kind == "fork" and s in cache and other not in cache:
            kept = cache.fork(s, other)
            contents[other] = [torch.cat(contents[s])[:kept]] if contents.get(s) else []
        elif kind == "free" and s in cache:
            cache.free(s)
            del contents[s]
        live = [q for q in range(4) if q in cache]
        assert_gather_matches(cache, live, contents)
    for q in range(4):
        if q in cache:
            cache.free(q)
    assert cache.allocator.num_free == 16
