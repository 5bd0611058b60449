"""The cross-rank argument check run before a payload collective (`check=True`).

Every rank contributes one fixed-length int64 row describing its call (which collective,
whether its own arguments were valid, dtype, shape, dim, splits) and one `all_gather`
gives every rank every row. Each rank then applies the same rules to the same rows, so
either every rank raises InvalidInputError or none does: a mismatch never leaves part of
the group waiting in a payload collective. The row length depends only on the group size,
so even a rank calling a different collective, or passing something that is not a tensor,
takes part in the exchange and is reported instead of hanging the group.

Cost: one all_gather of `world_size * (15 + 2 * world_size)` int64 values, on the CPU
whenever the group serves CPU tensors (no device sync); measured by
`glm5-hal bench --collectives` (line "metadata check").
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import InvalidInputError
from .group import GroupInfo, guard, metadata_device

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "moe_dispatch",
       "moe_combine")

_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32",
                "int64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64")
_DTYPES = tuple(getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n))
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_NOT_A_TENSOR = -1
_OTHER_DTYPE = -2

SHAPE_SLOTS = 8
_HEADER = 7          # op, error, dtype, ndim, a, b, c
_UNSET = -1          # an optional vector entry the caller did not give


@dataclasses.dataclass(frozen=True)
class Row:
    """One rank's description of its call."""
    op: int
    error: bool
    dtype: int
    ndim: int
    a: int
    b: int
    c: int
    shape: tuple[int, ...]
    va: tuple[int, ...]
    vb: tuple[int, ...]

    def shape_text(self) -> str:
        if self.ndim > SHAPE_SLOTS:
            return f"{list(self.shape[:SHAPE_SLOTS - 1])} + {self.ndim - SHAPE_SLOTS + 1} more dims"
        return str(list(self.shape[:self.ndim]))


def dtype_code(t: torch.Tensor) -> int:
    return _DTYPE_CODE.get(t.dtype, _OTHER_DTYPE)


def dtype_name(code: int) -> str:
    if 0 <= code < len(_DTYPES):
        return str(_DTYPES[code]).removeprefix("torch.")
    return "a non-tensor" if code == _NOT_A_TENSOR else "an unlisted dtype"


def shape_slots(shape: Sequence[int]) -> list[int]:
    """The shape padded with -1 to SHAPE_SLOTS entries; longer shapes keep their first
    SHAPE_SLOTS-1 sizes and fold the rest into one deterministic checksum."""
    shape = list(shape)
    if len(shape) <= SHAPE_SLOTS:
        return shape + [-1] * (SHAPE_SLOTS - len(shape))
    folded = 0
    for s in shape[SHAPE_SLOTS - 1:]:
        folded = (folded * 1_000_003 + s + 1) % (2 ** 61 - 1)
    return shape[:SHAPE_SLOTS - 1] + [folded]


def row(op: str, t: torch.Tensor, world: int, *, shape: Sequence[int] | None = None,
        a: int = 0, b: int = 0, c: int = 0, va: Sequence[int] | None = None,
        vb: Sequence[int] | None = None) -> list[int]:
    """The row for a call whose local checks passed. `shape` defaults to t.shape (callers
    blank out sizes that may legitimately differ across ranks)."""
    shape = list(t.shape) if shape is None else list(shape)
    unset = [_UNSET] * world
    return ([OPS.index(op), 0, dtype_code(t), t.dim(), a, b, c] + shape_slots(shape)
            + list(va if va is not None else unset) + list(vb if vb is not None else unset))


def error_row(op: str, world: int) -> list[int]:
    return [OPS.index(op), 1, _NOT_A_TENSOR, 0, 0, 0, 0] + [-1] * SHAPE_SLOTS + [_UNSET] * (2 * world)


def exchange(op: str, info: GroupInfo, mine: list[int], like: object) -> list[Row]:
    device = metadata_device(info, like)
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = torch.empty(info.size * local.numel(), dtype=torch.int64, device=device)
    with guard(f"{op} (metadata check)", info):
        all_gather_into(gathered, local, info.pg)
    flat = gathered.tolist()
    n, w = len(mine), info.size
    rows = []
    for r in range(w):
        v = flat[r * n:(r + 1) * n]
        s = _HEADER + SHAPE_SLOTS
        rows.append(Row(v[0], bool(v[1]), v[2], v[3], v[4], v[5], v[6], tuple(v[_HEADER:s]),
                        tuple(v[s:s + w]), tuple(v[s + w:s + 2 * w])))
    return rows


def all_gather_into(out: torch.Tensor, t: torch.Tensor, pg) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=pg)


def prologue(op: str, info: GroupInfo, check: bool, local: Callable[[], list[int]],
             like: object) -> list[Row] | None:
    """Runs the local checks (`local()` raises InvalidInputError or returns this rank's
    row). Without `check`, a local failure raises at once and no rows are exchanged. With
    `check`, the failure is deferred until every rank has seen every row, then every rank
    raises; returns the rows when every rank's call is valid and is the same collective."""
    if not check:
        local()
        return None
    try:
        mine, error = local(), None
    except InvalidInputError as exc:
        mine, error = error_row(op, info.size), exc
    rows = exchange(op, info, mine, like)
    if error is not None:
        raise error
    bad = [r for r, row_ in enumerate(rows) if row_.error]
    if bad:
        raise InvalidInputError(op, "(arguments on another rank)", "valid arguments on every rank "
                                "of the group", f"invalid arguments on rank(s) {bad} of "
                                f"{info.size} (their InvalidInputError says which)")
    for r, row_ in enumerate(rows):
        if row_.op != OPS.index(op):
            raise InvalidInputError(op, "(collective)", f"every rank of the group calling {op}",
                                    f"rank {r} called {OPS[row_.op] if 0 <= row_.op < len(OPS) else '?'}")
    return rows


def agree(op: str, arg: str, info: GroupInfo, rows: list[Row], what: str,
          value: Callable[[Row], object], show: Callable[[Row], object] | None = None) -> None:
    """Raises unless `value(row)` is the same on every rank; the message shows this rank's
    value against the first rank that differs from it (or from rank 0)."""
    values = [value(r) for r in rows]
    if all(v == values[0] for v in values):
        return
    show = show or value
    me = info.rank
    other = next((r for r, v in enumerate(values) if v != values[me]), None)
    raise InvalidInputError(op, arg, f"the same {what} on every rank of the group (this rank "
                            f"{me}: {show(rows[me])})", f"{show(rows[other])} on rank {other}")
