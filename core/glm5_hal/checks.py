"""Input validation helpers shared by the op definitions.

Metadata checks (type, dim, shape, dtype, device, strides) are declared per op and compiled
(glm5_hal.contract); the helpers here raise `InvalidInputError(op, arg, expected, actual)`
for the few hand-written ones and serve the ops' data-dependent value checks.
"""
from __future__ import annotations

import math
from typing import Iterable, NoReturn, Sequence

import torch

from .errors import InvalidInputError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32,)
SLOT_DTYPES = (torch.int32, torch.int64)
FP8 = torch.float8_e4m3fn


def fail(op: str, arg: str, expected: object, actual: object) -> NoReturn:
    raise InvalidInputError(op, arg, expected, actual)


def _name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def dtype_list(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(_name(d) for d in dtypes)


def tensor(op: str, arg: str, t: object, *, ndim: int | None = None, min_ndim: int | None = None,
           dtypes: Sequence[torch.dtype] | None = None) -> torch.Tensor:
    """`t` is a tensor with the given rank and one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        fail(op, arg, "a torch.Tensor", type(t).__name__)
    if ndim is not None and t.dim() != ndim:
        fail(op, arg, f"a {ndim}-d tensor", f"shape {list(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        fail(op, arg, f"at least {min_ndim} dims", f"shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, arg, f"dtype {dtype_list(dtypes)}", _name(t.dtype))
    return t


def shape(op: str, arg: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """`t.shape` matches `expected` (None matches any size)."""
    actual = t.shape
    if len(actual) == len(expected):
        for a, e in zip(actual, expected):  # a plain loop: this runs on every call
            if e is not None and a != e:
                break
        else:
            return
    shown = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
    fail(op, arg, f"shape {shown}", f"shape {list(actual)}")


def same_device(op: str, ref_arg: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Every tensor in `others` lives on `ref`'s device."""
    device = ref.device
    for arg, t in others.items():
        if t is not None and t.device != device:
            fail(op, arg, f"a tensor on {device} (the device of '{ref_arg}')", f"device {t.device}")


def is_paged(t: torch.Tensor) -> bool:
    """A paged cache [num_blocks, ...] an op writes in place: each block (the dims after the
    first) row-major contiguous, blocks not overlapping. Contiguous caches are paged; so is a
    block-strided view into a serving engine's pages (vLLM's indexer page holds a block's FP8
    rows and then its scales). Block b starts b * stride(0) elements after the first."""
    shape, strides = t.shape, t.stride()
    extent = 1
    for d in range(len(shape) - 1, 0, -1):
        if shape[d] != 1 and strides[d] != extent:
            return False
        extent *= shape[d]
    return len(shape) >= 1 and (shape[0] <= 1 or extent == 0 or strides[0] >= extent)


OVERLAP_EXPECTED = "memory apart from the other cache argument's (or interleaved with it page by page)"


def pages_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two paged caches one call writes share no byte: their address ranges are apart,
    or they interleave page by page (one page stride, disjoint spans within a page)."""
    apart = _native.pages_apart(a, b) if _native is not None else None
    if apart is not None:
        return apart
    if a.numel() == 0 or b.numel() == 0:
        return True
    def span(t):
        block = t.element_size() * math.prod(t.shape[1:])
        low = t.data_ptr()
        return low, low + (t.shape[0] - 1) * t.stride(0) * t.element_size() + block, block
    a_lo, a_hi, a_block = span(a)
    b_lo, b_hi, b_block = span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return True
    page = a.stride(0) * a.element_size()
    if a.shape[0] == b.shape[0] and page > 0 and page == b.stride(0) * b.element_size():
        offset = (b_lo - a_lo) % page
        if offset >= a_block and offset + b_block <= page:
            return True
    return False


def integer(op: str, arg: str, v: object, *, min_value: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail(op, arg, "an int", repr(v))
    if min_value is not None and v < min_value:
        fail(op, arg, f"an int >= {min_value}", v)
    return v


def choice(op: str, arg: str, v: object, options: Sequence[object]) -> None:
    if v not in options:
        fail(op, arg, f"one of {list(options)}", repr(v))


# -- value checks ------------------------------------------------------------------------------
# Data-dependent, so never at trace time. Each primitive finds the first violation: natively on
# contiguous int CPU tensors (glm5_hal._C reads the tensor and scans host memory, well under a
# microsecond; csrc/bindings_value_checks.cpp), with torch ops elsewhere (which reads device data:
# dispatch runs value checks off the CPU only under GLM5_HAL_CHECKS=full). A native primitive
# returns None for a tensor it does not read, and the torch formulation runs.
try:
    from . import _C as _native
except ImportError:  # a source tree without the extension: the torch path serves
    _native = None


def first_outside(t: torch.Tensor, low: int, high: int, allowed: int | None = None) -> int:
    """Flat index of the first element of the int tensor `t` outside [low, high) other than
    `allowed`, or -1."""
    if _native is not None:
        hit = _native.first_outside(t, low, high, allowed)
        if hit is not None:
            return hit
    if t.numel() == 0:
        return -1
    # a bound outside the dtype's range would wrap in the comparison (2**31 as int32 is -2**31)
    info = torch.iinfo(t.dtype)
    bad = torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    if low > info.min:   # out of place throughout: this also runs under torch.func transforms
        bad = bad | (t < low)
    if high <= info.max:
        bad = bad | (t >= high)
    if allowed is not None:
        bad = bad & (t != allowed)
    hit = bad.flatten().nonzero()
    return int(hit[0, 0]) if hit.numel() else -1


def smallest_repeat(t: torch.Tensor) -> int:
    """The smallest value >= 0 occurring more than once in the int tensor `t`, or -1."""
    if _native is not None:
        repeated = _native.smallest_repeat(t)
        if repeated is not None:
            return repeated
    if t.numel() < 2:
        return -1
    used = t[t >= 0].sort().values
    repeated = used[1:][used[1:] == used[:-1]]
    return int(repeated[0]) if repeated.numel() else -1


def total(t: torch.Tensor) -> int:
    """The sum of the int tensor `t`."""
    if _native is not None:
        count = _native.sum_of(t)
        if count is not None:
            return count
    return int(t.sum())


def first_bad_block(block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                    num_blocks: int) -> tuple[int, int] | None:
    """The first (b, j) whose block holds part of [0, context_lens[b]) but whose id is outside
    [0, num_blocks), or None. context_lens must already be in [0, max_blocks * block_size]."""
    if _native is not None:
        hit = _native.first_bad_block(block_table, context_lens, block_size, num_blocks)
        if hit is not None:
            return None if hit[0] < 0 else hit
    batch, max_blocks = block_table.shape
    if batch == 0 or max_blocks == 0:
        return None
    used = (context_lens.long() + block_size - 1) // block_size
    in_use = torch.arange(max_blocks, device=block_table.device) < used.unsqueeze(-1)
    hit = (in_use & ((block_table < 0) | (block_table >= num_blocks))).nonzero()
    return (int(hit[0, 0]), int(hit[0, 1])) if hit.numel() else None


def first_bad_slot(slot_mapping: torch.Tensor, num_slots: int) -> tuple[int, int]:
    """The cache writes' value check on slot_mapping in one pass: (1, i) for the first flat
    index i whose slot is outside [0, num_slots) and not -1, else (2, s) for the smallest slot s
    given more than once, else (0, -1)."""
    if _native is not None:
        hit = _native.first_bad_slot(slot_mapping, num_slots)
        if hit is not None:
            return hit
    i = first_outside(slot_mapping, 0, num_slots, -1)
    if i >= 0:
        return 1, i
    repeated = smallest_repeat(slot_mapping)
    return (2, repeated) if repeated >= 0 else (0, -1)


def first_bad_write(slot_mapping: torch.Tensor, cache: torch.Tensor,
                    other: torch.Tensor | None = None) -> tuple[int, int]:
    """A paged cache write's whole value check in one call: (3, -1) if `other`, a second cache
    the call writes, shares bytes with `cache` (`pages_apart`), else `first_bad_slot` with the
    slots of `cache` (its first two sizes)."""
    if _native is not None:
        hit = _native.first_bad_write(slot_mapping, cache, other)
        if hit is not None:
            return hit
    if other is not None and not pages_apart(cache, other):
        return 3, -1
    shape = cache.shape
    return first_bad_slot(slot_mapping, shape[0] * shape[1])


def first_bad_paging(block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                     num_blocks: int) -> tuple[int, int, int]:
    """The paged ops' value check in one pass over each tensor: (1, b, -1) for the first
    context_lens[b] outside [0, max_blocks * block_size], else (2, b, j) for the first block in
    use (`first_bad_block`) whose id is outside [0, num_blocks), else (0, -1, -1)."""
    if _native is not None:
        hit = _native.first_bad_paging(block_table, context_lens, block_size, num_blocks)
        if hit is not None:
            return hit
    b = first_outside(context_lens, 0, block_table.shape[1] * block_size + 1)
    if b >= 0:
        return 1, b, -1
    bad = first_bad_block(block_table, context_lens, block_size, num_blocks)
    return (0, -1, -1) if bad is None else (2, *bad)


def first_bad_range(start: torch.Tensor, end: torch.Tensor, num_keys: int) -> tuple[int, int]:
    """Key ranges 0 <= start[t] <= end[t] <= num_keys: (1, t) for the first end outside
    [0, num_keys], else (2, t) for the first start < 0 or > end[t], else (0, -1)."""
    if _native is not None:
        hit = _native.first_bad_range(start, end, num_keys)
        if hit is not None:
            return hit
    if start.numel() == 0:
        return 0, -1
    t = first_outside(end, 0, num_keys + 1)
    if t >= 0:
        return 1, t
    hit = ((start < 0) | (start > end)).nonzero()
    return (2, int(hit[0, 0])) if hit.numel() else (0, -1)


def expert_counts(op: str, tokens_per_expert: torch.Tensor, rows: int, rows_arg: str) -> None:
    """`tokens_per_expert` (argument of that name) holds counts >= 0 summing to `rows`, the
    rows of the argument `rows_arg` (the grouped GEMMs' expert-contiguous layout)."""
    summing = f"counts summing to {rows} (the rows of '{rows_arg}')"
    if tokens_per_expert.numel() == 0:
        if rows != 0:
            fail(op, "tokens_per_expert", summing, "no experts")
        return
    e = first_outside(tokens_per_expert, 0, 2**31)
    if e >= 0:
        fail(op, "tokens_per_expert", "counts >= 0", f"{int(tokens_per_expert[e])} for expert {e}")
    count = total(tokens_per_expert)
    if count != rows:
        fail(op, "tokens_per_expert", summing, f"sum {count}")


def index_range(op: str, arg: str, t: torch.Tensor, low: int, high: int, *,
                allow: Sequence[int] = ()) -> None:
    """Every element of `t` is in [low, high) or one of `allow` (at most one value)."""
    if len(allow) > 1:
        raise ValueError("index_range: at most one allowed value")
    i = first_outside(t, low, high, allow[0] if allow else None)
    if i >= 0:
        allowed = f" (or {', '.join(map(str, allow))})" if allow else ""
        fail(op, arg, f"values in [{low}, {high}){allowed}", f"{int(t.flatten()[i])} at flat index {i}")
