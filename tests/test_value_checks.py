"""The value-check primitives (glm5_hal.checks): the native scans used on CPU tensors agree
with the torch formulation used on other devices, on random inputs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from glm5_hal import _C, checks as C

ints = st.lists(st.integers(-5, 40), max_size=40)


def both(monkeypatch, fn, *args):
    native = fn(*args)
    with monkeypatch.context() as m:
        m.setattr(C, "_native", None)
        fallback = fn(*args)
    return native, fallback


@settings(max_examples=60, deadline=None)
@given(values=ints, dtype=st.sampled_from([torch.int32, torch.int64]), allowed=st.sampled_from([None, -1]))
def test_first_outside(values, dtype, allowed):
    t = torch.tensor(values, dtype=dtype)
    expected = next((i for i, v in enumerate(values) if not (0 <= v < 30) and v != allowed), -1)
    with pytest.MonkeyPatch.context() as m:
        assert both(m, C.first_outside, t, 0, 30, allowed) == (expected, expected)


def test_first_outside_takes_bounds_beyond_the_dtype(monkeypatch):
    """grouped_gemm checks counts against [0, 2**31): as an int32 scalar that bound would wrap."""
    t = torch.tensor([3, 0, 5, 2**31 - 1], dtype=torch.int32)
    assert both(monkeypatch, C.first_outside, t, 0, 2**31) == (-1, -1)
    assert both(monkeypatch, C.first_outside, t, -2**40, 4) == (2, 2)


@settings(max_examples=60, deadline=None)
@given(values=ints)
def test_smallest_repeat(values):
    t = torch.tensor(values, dtype=torch.int32)
    seen = [v for v in values if v >= 0]
    repeats = sorted({v for v in seen if seen.count(v) > 1})
    with pytest.MonkeyPatch.context() as m:
        assert both(m, C.smallest_repeat, t) == ((repeats or [-1])[0],) * 2


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 12), min_size=1, max_size=5), ids=st.lists(st.integers(-2, 6), min_size=15, max_size=15))
def test_first_bad_block(lens, ids):
    batch, max_blocks, block_size, num_blocks = len(lens), 3, 4, 5
    table = torch.tensor(ids[: batch * max_blocks], dtype=torch.int32).view(batch, max_blocks)
    context = torch.tensor(lens, dtype=torch.int32)
    expected = None
    for b, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            if expected is None and not 0 <= int(table[b, j]) < num_blocks:
                expected = (b, j)
    with pytest.MonkeyPatch.context() as m:
        assert both(m, C.first_bad_block, table, context, block_size, num_blocks) == (expected, expected)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(-2, 14), min_size=1, max_size=5), ids=st.lists(st.integers(-2, 6), min_size=15, max_size=15))
def test_first_bad_paging(lens, ids):
    """The paged ops' whole value check: context_lens in [0, max_blocks * block_size] first,
    then the blocks in use (first_bad_block)."""
    batch, max_blocks, block_size, num_blocks = len(lens), 3, 4, 5
    table = torch.tensor(ids[: batch * max_blocks], dtype=torch.int32).view(batch, max_blocks)
    context = torch.tensor(lens, dtype=torch.int32)
    expected = next(((1, b, -1) for b, n in enumerate(lens) if not 0 <= n <= max_blocks * block_size), None)
    for b, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            if expected is None and not 0 <= int(table[b, j]) < num_blocks:
                expected = (2, b, j)
    expected = expected or (0, -1, -1)
    with pytest.MonkeyPatch.context() as m:
        assert both(m, C.first_bad_paging, table, context, block_size, num_blocks) == (expected, expected)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-3, 12), max_size=20), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_first_bad_slot(values, dtype):
    """The cache writes' slot check: out of range (-1 allowed) first, then repeats."""
    t = torch.tensor(values, dtype=dtype)
    expected = next(((1, i) for i, v in enumerate(values) if not 0 <= v < 10 and v != -1), None)
    repeats = sorted({v for v in values if v >= 0 and values.count(v) > 1})
    expected = expected or ((2, repeats[0]) if repeats else (0, -1))
    with pytest.MonkeyPatch.context() as m:
        assert both(m, C.first_bad_slot, t, 10) == (expected, expected)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-3, 12), max_size=20), overlap=st.sampled_from([None, False, True]))
def test_first_bad_write(values, overlap):
    """A cache write's whole value check: the second cache apart from the first, then the slots
    (num_slots from the cache's first two sizes, here 5 * 2)."""
    buffer = torch.zeros(40)
    cache = buffer[:20].view(5, 2, 2)
    other = None if overlap is None else buffer[10:15].view(5, 1) if overlap else buffer[20:25].view(5, 1)
    slots = torch.tensor(values, dtype=torch.int64)
    expected = (3, -1) if overlap else C.first_bad_slot(slots, 10)
    with pytest.MonkeyPatch.context() as m:
        assert both(m, C.first_bad_write, slots, cache, other) == (expected, expected)


def _bytes_of(t: torch.Tensor) -> set[int]:
    """Every byte address a view covers (the oracle: small views only)."""
    base, size = t.data_ptr(), t.element_size()
    index = torch.zeros(t.shape, dtype=torch.int64)
    for d in range(t.dim()):
        shape = [1] * t.dim()
        shape[d] = t.shape[d]
        index = index + torch.arange(t.shape[d]).view(shape) * t.stride(d)
    return {base + int(i) * size + j for i in index.flatten() for j in range(size)}


@settings(max_examples=80, deadline=None)
@given(page=st.integers(1, 12), blocks=st.integers(0, 4), a_width=st.integers(0, 6), b_width=st.integers(0, 6),
       b_offset=st.integers(-8, 30), same_buffer=st.booleans())
def test_pages_apart(page, blocks, a_width, b_width, b_offset, same_buffer):
    """Paged views of one buffer (or two buffers): the native layout check says whether they
    share a byte, as their byte sets do, and the torch attributes' formulation agrees,
    overlapping or not, interleaved page by page or not."""
    buffer = torch.zeros(64 + 8 * 12 * 5, dtype=torch.float32)
    other = buffer if same_buffer else torch.zeros_like(buffer)
    a = buffer.as_strided((blocks, a_width), (page, 1), 8)
    b = other.as_strided((blocks, b_width), (page, 1), 8 + b_offset)
    # the byte sets are the truth; views with one page stride and block count, as here, are
    # where the rule is exact (elsewhere it may refuse caches that share no byte, never the reverse)
    truth = not (_bytes_of(a) & _bytes_of(b))
    native = _C.pages_apart(a, b)
    assert native is truth
    with pytest.MonkeyPatch.context() as m:
        m.setattr(C, "_native", None)
        assert C.pages_apart(a, b) is native


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(-2, 9), st.integers(-2, 9)), max_size=8))
def test_first_bad_range(pairs):
    start = torch.tensor([p[0] for p in pairs], dtype=torch.int32)
    end = torch.tensor([p[1] for p in pairs], dtype=torch.int32)
    expected = next(((1, t) for t, (_, e) in enumerate(pairs) if not 0 <= e <= 7), None) or next(
        ((2, t) for t, (s, e) in enumerate(pairs) if s < 0 or s > e), (0, -1))
    with pytest.MonkeyPatch.context() as m:
        assert both(m, C.first_bad_range, start, end, 7) == (expected, expected)


def test_total_and_non_contiguous_inputs_take_the_torch_path():
    t = torch.arange(10, dtype=torch.int32)
    assert C.total(t) == 45 and C.total(t[::2]) == 20
    assert C.first_outside(t[::3], 0, 6) == 2          # 6 at flat index 2 of the strided view


class _Sub(torch.Tensor):
    pass


def test_the_native_scans_take_only_tensors_they_read_exactly():
    # glm5_hal._C reads the tensor itself (csrc/bindings_value_checks.cpp); anything it cannot
    # scan in place it declines with None, and the torch formulation runs instead
    t = torch.arange(10, dtype=torch.int32)
    assert _C.first_outside(t, 0, 5, None) == 5
    assert _C.first_outside(t, 0, 5, 7) == 5 and _C.first_outside(t[:6], 0, 5, 5) == -1
    assert _C.first_outside(torch.zeros(0, dtype=torch.int64), 0, 1, None) == -1
    assert _C.smallest_repeat(torch.tensor([3, 1, 3, 1, -1, -1])) == 1
    assert _C.sum_of(torch.tensor([[1, 2], [3, 4]])) == 10
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    lens = torch.tensor([2, 2], dtype=torch.int32)
    assert _C.first_bad_block(table, lens, 1, 4) == (1, 1)
    assert _C.first_bad_range(torch.tensor([0, 3], dtype=torch.int32),
                              torch.tensor([2, 2], dtype=torch.int32), 4) == (2, 1)
    for declined in (t[::2], t.float(), t.to("meta"), t.as_subclass(_Sub), [1, 2]):
        assert _C.first_outside(declined, 0, 5, None) is None
        assert _C.smallest_repeat(declined) is None and _C.sum_of(declined) is None
    assert _C.first_outside(t, 0, 2**70, None) is None          # a bound beyond int64
    assert _C.first_bad_block(table.long(), lens, 1, 4) is None  # the scan reads int32 tables
    assert _C.first_bad_block(table, lens[:1], 1, 4) is None     # lens must match the table
    assert _C.first_bad_range(lens, lens[:1], 4) is None
    assert _C.first_bad_paging(table, lens, 1, 4) == (2, 1, 1)
    assert _C.first_bad_paging(table, torch.tensor([2, 3], dtype=torch.int32), 1, 4) == (1, 1, -1)
    assert _C.first_bad_paging(table.long(), lens, 1, 4) is None and _C.first_bad_paging(table, lens[:1], 1, 4) is None
    assert _C.first_bad_paging(table[:, ::2], lens, 1, 4) is None    # not contiguous: the torch path
    assert _C.first_bad_paging(table, lens, 2**62, 4) is None        # max_blocks * block_size beyond int64
    assert _C.first_bad_slot(torch.tensor([3, -1, -1, 3]), 4) == (2, 3)
    assert _C.first_bad_slot(torch.tensor([3, -2]), 4) == (1, 1) and _C.first_bad_slot(t[::2], 4) is None
    cache = torch.zeros(4, 3)
    assert _C.pages_apart(cache[:2], cache[2:]) is True and _C.pages_apart(cache, cache[1:]) is False
    assert _C.pages_apart(cache.as_subclass(_Sub), cache) is None and _C.pages_apart(cache, [1]) is None
    assert _C.first_bad_write(torch.tensor([3, 0]), cache.view(2, 2, 3), None) == (0, -1)
    assert _C.first_bad_write(torch.tensor([0, 4]), cache.view(2, 2, 3), None) == (1, 1)   # 4 slots
    assert _C.first_bad_write(torch.tensor([0]), cache[:2], cache[1:]) == (3, -1)
    assert _C.first_bad_write(torch.tensor([0]), cache[:, 0], None) is None   # a cache of one dim
    with pytest.raises(TypeError, match="takes 4 arguments"):
        _C.first_outside(t, 0, 5)
