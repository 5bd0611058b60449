"""Typed, validated collectives that return new tensors.

Every function here:
- returns a NEW tensor and never modifies its input (inputs may be non-contiguous);
- computes the mathematical result on any group size, including uneven sizes and zero-size
  parts, on any dim, building what the process-group backend lacks (gloo has no uneven
  all_gather) from what every backend has (padded all_gather, all_to_all_single);
- moves data-only payloads (all_gather, all_to_all, broadcast) as raw bytes, so any dtype
  moves (fp8, bool, int16, complex), whatever the backend's dtype list;
- with `check=True` (default) runs one small metadata all_gather first (see
  `glm5_hal.dist.meta`) so that a wrong split, a dim out of range or a dtype/shape that
  differs across ranks raises InvalidInputError on every rank instead of hanging the group.
  `check` must be the same on every rank of a call. With `check=False` only the local checks
  run; cross-rank mismatches are then undefined behaviour (wrong data, a backend error or a
  timeout);
- turns a backend failure into CollectiveError, and a peer that never calls into
  CollectiveTimeoutError after the group's timeout.

Ranks (`src`) and split lists are in the group's rank numbering.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from .. import checks as C
from ..errors import InvalidInputError
from . import meta
from .group import GroupInfo, group_info, guard, served_device_types

#: dtypes the reducing collectives accept (what gloo, NCCL and the vendor libraries share).
REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                 torch.uint8, torch.int32, torch.int64)
#: reduction names; "avg" is "sum" then a division by the group size (floating dtypes only).
REDUCE_OPS = ("sum", "avg", "max", "min", "product")


# -- local checks -------------------------------------------------------------------------
def _tensor(op: str, arg: str, t: object, info: GroupInfo, *, min_ndim: int = 0,
            dtypes: Sequence[torch.dtype] | None = None) -> torch.Tensor:
    C.tensor(op, arg, t, min_ndim=min_ndim or None, dtypes=dtypes)
    served = served_device_types(info)
    if served is not None and t.device.type not in served:
        C.fail(op, arg, f"a tensor on a device the process group serves ({', '.join(served)})",
               f"device {t.device}")
    return t


def _dim(op: str, dim: object, ndim: int) -> int:
    C.integer(op, "dim", dim)
    if not -ndim <= dim < ndim:
        C.fail(op, "dim", f"an int in [{-ndim}, {ndim}) for a {ndim}-d tensor", dim)
    return dim % ndim


def _reduce_op(op: str, name: object, dtype: torch.dtype) -> int:
    C.choice(op, "op", name, REDUCE_OPS)
    if name == "avg" and not dtype.is_floating_point:
        C.fail(op, "op", f"sum, max, min or product for {str(dtype).removeprefix('torch.')} "
               "(avg needs a floating dtype)", "'avg'")
    return REDUCE_OPS.index(name)


def _splits(op: str, arg: str, v: object, world: int, total: int | None = None) -> list[int]:
    """`v` is `world` non-negative ints (list, tuple or 1-d tensor) summing to `total`."""
    if isinstance(v, torch.Tensor) and v.dim() == 1 and not v.is_floating_point():
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        C.fail(op, arg, f"a list of {world} ints (one per rank of the group)", type(v).__name__)
    if len(v) != world:
        C.fail(op, arg, f"{world} sizes (one per rank of the group)", f"{len(v)} sizes: {list(v)}")
    for i, s in enumerate(v):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            C.fail(op, arg, "non-negative ints", f"{s!r} at index {i} of {list(v)}")
    if total is not None and sum(v) != total:
        C.fail(op, arg, f"sizes summing to {total}", f"{list(v)} (sum {sum(v)})")
    return list(v)


def _ints(v: object) -> list[int]:
    return v.tolist() if isinstance(v, torch.Tensor) else list(v)


# -- bytes: data-only payloads move as uint8 rows ---------------------------------------------
def _as_rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Size]:
    """`t` with `dim` moved first, as a contiguous uint8 [n, row_bytes] tensor, plus the
    sizes of the other dims."""
    x = t.movedim(dim, 0).contiguous()
    rest = x.shape[1:]
    if x.numel() == 0:  # empty tensors may keep any strides, which view(uint8) refuses
        return torch.empty(x.shape[0], math.prod(rest) * t.element_size(), dtype=torch.uint8,
                           device=t.device), rest
    return x.reshape(x.shape[0], math.prod(rest)).view(torch.uint8), rest


def _from_rows(b: torch.Tensor, dtype: torch.dtype, rest: torch.Size, dim: int) -> torch.Tensor:
    if b.numel() == 0:
        return torch.empty((b.shape[0], *rest), dtype=dtype, device=b.device).movedim(0, dim)
    return b.view(dtype).reshape(b.shape[0], *rest).movedim(0, dim)


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
         in_splits: list[int] | None, info: GroupInfo, op: str) -> None:
    with guard(op, info):
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=info.pg)


def _torch_reduce_op(code: int):
    return {0: dist.ReduceOp.SUM, 1: dist.ReduceOp.SUM, 2: dist.ReduceOp.MAX,
            3: dist.ReduceOp.MIN, 4: dist.ReduceOp.PRODUCT}[code]


# -- all_reduce -----------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, op: str = "sum", *, group=None, check: bool = True) -> torch.Tensor:
    """Elementwise reduction of `t` over the ranks of `group`; every rank gets the result.

    t: same shape and dtype on every rank; dtype one of REDUCE_DTYPES.
    op: "sum" | "avg" | "max" | "min" | "product". Floating sums are computed by the
        backend in `t`'s dtype; their rounding (order of additions) is the backend's.
    Returns a new contiguous tensor; `t` is not modified.
    """
    name = "all_reduce"
    info = group_info(name, group)

    def local() -> list[int]:
        _tensor(name, "t", t, info, dtypes=REDUCE_DTYPES)
        code = _reduce_op(name, op, t.dtype)
        return meta.row(name, t, info.size, a=code)

    rows = meta.prologue(name, info, check, local, t)
    if rows is not None:
        _agree_tensor(name, "t", info, rows)
        meta.agree(name, "op", info, rows, "reduction", lambda r: r.a, lambda r: REDUCE_OPS[r.a])
    out = t.clone(memory_format=torch.contiguous_format)
    with guard(name, info):
        dist.all_reduce(out, op=_torch_reduce_op(REDUCE_OPS.index(op)), group=info.pg)
    if op == "avg":
        out.div_(info.size)
    return out


def _agree_tensor(op: str, arg: str, info: GroupInfo, rows: list[meta.Row], what: str = "shape") -> None:
    meta.agree(op, arg, info, rows, "dtype", lambda r: r.dtype, lambda r: meta.dtype_name(r.dtype))
    meta.agree(op, arg, info, rows, what, lambda r: (r.ndim, r.shape), lambda r: r.shape_text())


# -- all_gather -----------------------------------------------------------------------------
def all_gather(t: torch.Tensor, dim: int = 0, *, sizes: Sequence[int] | None = None, group=None,
               check: bool = True) -> torch.Tensor:
    """The concatenation along `dim` of every rank's `t`, in rank order, on every rank.

    t: at least 1-d; same dtype and same sizes on every dim except `dim` on every rank.
        Sizes along `dim` may differ across ranks (including 0).
    sizes: optional sizes along `dim` of every rank's `t`. With check=True they are learned
        from the metadata exchange (and verified if given); with check=False, give them when
        they differ across ranks, otherwise every rank is assumed to have `t.shape[dim]`.
    Any dtype. Returns a new contiguous tensor; `t` is not modified.
    """
    name = "all_gather"
    info = group_info(name, group)
    world = info.size

    def local() -> list[int]:
        _tensor(name, "t", t, info, min_ndim=1)
        d = _dim(name, dim, t.dim())
        given = None if sizes is None else _splits(name, "sizes", sizes, world)
        if given is not None and given[info.rank] != t.shape[d]:
            C.fail(name, "sizes", f"sizes[{info.rank}] == t.shape[{d}] on rank {info.rank}", f"{given}, "
                   f"t.shape[{d}] = {t.shape[d]}")
        others = list(t.shape)
        others[d] = 0  # the gathered dim may differ across ranks
        return meta.row(name, t, world, shape=others, a=d, b=t.shape[d], va=given)

    rows = meta.prologue(name, info, check, local, t)
    d = dim % t.dim()
    if rows is not None:
        meta.agree(name, "dim", info, rows, "dim (after wrapping negative dims)", lambda r: r.a)
        _agree_tensor(name, "t", info, rows, f"sizes on every dim but dim {d}")
        actual = [r.b for r in rows]
        for r, row_ in enumerate(rows):
            if row_.va[0] != meta._UNSET and list(row_.va) != actual:
                raise InvalidInputError(name, "sizes", f"the sizes along dim {d} of every rank's t: "
                                        f"{actual}", f"{list(row_.va)} on rank {r}")
        all_sizes = actual
    else:
        all_sizes = _ints(sizes) if sizes is not None else [t.shape[d]] * world

    rows_b, rest = _as_rows(t, d)
    row_bytes = rows_b.shape[1]
    widest = max(all_sizes)
    if widest == 0 or row_bytes == 0:  # nothing to move; every rank knows it from the same sizes
        return torch.empty((sum(all_sizes), *rest), dtype=t.dtype, device=t.device).movedim(0, d).contiguous()
    if rows_b.shape[0] != widest:  # uneven: gather padded rows, then drop the padding
        padded = rows_b.new_zeros(widest, row_bytes)
        padded[:rows_b.shape[0]] = rows_b
        rows_b = padded
    gathered = rows_b.new_empty(world * widest, row_bytes)
    with guard(name, info):
        meta.all_gather_into(gathered, rows_b, info.pg)
    if any(s != widest for s in all_sizes):
        keep = torch.cat([torch.arange(r * widest, r * widest + s, device=t.device)
                          for r, s in enumerate(all_sizes)])
        gathered = gathered.index_select(0, keep)
    return _from_rows(gathered, t.dtype, rest, d).contiguous()


# -- reduce_scatter --------------------------------------------------------------------------
def reduce_scatter(t: torch.Tensor, dim: int = 0, *, sizes: Sequence[int] | None = None,
                   op: str = "sum", group=None, check: bool = True) -> torch.Tensor:
    """Rank r gets the reduction over ranks of chunk r of `t` along `dim`.

    t: same shape and dtype on every rank; dtype one of REDUCE_DTYPES; at least 1-d.
    sizes: the chunk sizes along `dim` (one per rank, summing to t.shape[dim], the same on
        every rank; zeros allowed). Default: equal chunks (t.shape[dim] divisible by the
        group size).
    op: as in all_reduce. Equal chunks use the backend's reduce_scatter; uneven chunks an
        all_to_all_single followed by a local reduction over the received chunks.
    Returns a new tensor with t.shape[dim] replaced by sizes[rank]; `t` is not modified.
    """
    name = "reduce_scatter"
    info = group_info(name, group)
    world = info.size

    def local() -> list[int]:
        _tensor(name, "t", t, info, min_ndim=1, dtypes=REDUCE_DTYPES)
        d = _dim(name, dim, t.dim())
        code = _reduce_op(name, op, t.dtype)
        if sizes is None and t.shape[d] % world:
            C.fail(name, "t", f"t.shape[{d}] divisible by the group size {world}, or explicit "
                   "sizes=", f"shape {list(t.shape)}")
        chunks = [t.shape[d] // world] * world if sizes is None else \
            _splits(name, "sizes", sizes, world, t.shape[d])
        return meta.row(name, t, world, a=d, b=code, va=chunks)

    rows = meta.prologue(name, info, check, local, t)
    d = dim % t.dim()
    if rows is not None:
        _agree_tensor(name, "t", info, rows)
        meta.agree(name, "dim", info, rows, "dim (after wrapping negative dims)", lambda r: r.a)
        meta.agree(name, "op", info, rows, "reduction", lambda r: r.b, lambda r: REDUCE_OPS[r.b])
        meta.agree(name, "sizes", info, rows, "chunk sizes", lambda r: r.va, lambda r: list(r.va))
    chunks = [t.shape[d] // world] * world if sizes is None else _ints(sizes)
    x = t.movedim(d, 0).contiguous()
    rest = x.shape[1:]
    mine = chunks[info.rank]
    if all(c == mine for c in chunks):
        out = x.new_empty(mine, *rest)
        if x.numel():
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            with guard(name, info):
                fn(out, x, op=_torch_reduce_op(REDUCE_OPS.index(op)), group=info.pg)
    else:
        rows_b, _ = _as_rows(x, 0)
        received = rows_b.new_empty(world * mine, rows_b.shape[1])
        _a2a(received, rows_b, [mine] * world, chunks, info, name)
        parts = received.view(t.dtype).reshape(world, mine, *rest)
        if op in ("sum", "avg"):
            out = parts.sum(0, dtype=t.dtype)
        elif op == "max":
            out = parts.amax(0)
        elif op == "min":
            out = parts.amin(0)
        else:
            out = parts.prod(0, dtype=t.dtype)
    if op == "avg":
        out.div_(world)
    return out.movedim(0, d).contiguous()


# -- all_to_all ------------------------------------------------------------------------------
def all_to_all(t: torch.Tensor, output_splits: Sequence[int] | None = None,
               input_splits: Sequence[int] | None = None, *, group=None,
               check: bool = True) -> torch.Tensor:
    """Splits `t` along dim 0 into `input_splits` (chunk j goes to rank j) and returns the
    concatenation, in source-rank order, of the chunks every rank sent to this one.

    t: at least 1-d; same dtype and same sizes on dims 1.. on every rank; any dtype.
    input_splits: rows sent to each rank (sum == t.shape[0]; zeros allowed). Default: equal
        chunks (t.shape[0] divisible by the group size).
    output_splits: rows received from each rank; must equal what the senders' input_splits
        say (verified with check=True). Default: learned from the senders (from the metadata
        exchange with check=True, else from one extra all_to_all of the counts).
    Returns a new tensor [sum(output_splits), *t.shape[1:]]; `t` is not modified.
    """
    name = "all_to_all"
    info = group_info(name, group)
    world = info.size

    def local() -> list[int]:
        _tensor(name, "t", t, info, min_ndim=1)
        if input_splits is None and t.shape[0] % world:
            C.fail(name, "t", f"t.shape[0] divisible by the group size {world}, or explicit "
                   "input_splits=", f"shape {list(t.shape)}")
        sent = [t.shape[0] // world] * world if input_splits is None else \
            _splits(name, "input_splits", input_splits, world, t.shape[0])
        expected = None if output_splits is None else _splits(name, "output_splits", output_splits, world)
        trailing = [0] + list(t.shape[1:])  # dim 0 may differ across ranks
        return meta.row(name, t, world, shape=trailing, va=sent, vb=expected)

    rows = meta.prologue(name, info, check, local, t)
    sent = [t.shape[0] // world] * world if input_splits is None else _ints(input_splits)
    if rows is not None:
        _agree_tensor(name, "t", info, rows, "sizes on dims 1..")
        for r, row_ in enumerate(rows):
            if row_.vb[0] == meta._UNSET:
                continue
            senders = [rows[j].va[r] for j in range(world)]
            if list(row_.vb) != senders:
                raise InvalidInputError(name, "output_splits", f"on rank {r}: the rows each rank "
                                        f"sends to it, {senders}", list(row_.vb))
        received = [rows[j].va[info.rank] for j in range(world)]
    elif output_splits is not None:
        received = _ints(output_splits)
    else:
        counts = torch.tensor(sent, dtype=torch.int64, device=t.device)
        got = torch.empty_like(counts)
        _a2a(got, counts, None, None, info, name + " (split exchange)")
        received = got.tolist()
    rows_b, rest = _as_rows(t, 0)
    out = rows_b.new_empty(sum(received), rows_b.shape[1])
    _a2a(out, rows_b, received, sent, info, name)
    return _from_rows(out, t.dtype, rest, 0)


# -- broadcast -------------------------------------------------------------------------------
def broadcast(t: torch.Tensor, src: int = 0, *, group=None, check: bool = True) -> torch.Tensor:
    """Rank `src`'s `t`, on every rank.

    t: on `src`, the data; on the other ranks, a tensor of the same shape and dtype whose
        values are ignored. Any dtype.
    src: a rank of `group` (group numbering).
    Returns a new contiguous tensor on every rank (a copy on `src`); `t` is not modified.
    """
    name = "broadcast"
    info = group_info(name, group)

    def local() -> list[int]:
        _tensor(name, "t", t, info)
        C.integer(name, "src", src)
        if not 0 <= src < info.size:
            C.fail(name, "src", f"a rank of the group in [0, {info.size})", src)
        return meta.row(name, t, info.size, a=src)

    rows = meta.prologue(name, info, check, local, t)
    if rows is not None:
        meta.agree(name, "src", info, rows, "src", lambda r: r.a)
        _agree_tensor(name, "t", info, rows)
    out = t.clone(memory_format=torch.contiguous_format)
    if out.numel():
        global_src = dist.get_global_rank(info.pg, src) if info.pg is not dist.group.WORLD else src
        with guard(name, info):
            dist.broadcast(out.reshape(-1).view(torch.uint8), src=global_src, group=info.pg)
    return out
