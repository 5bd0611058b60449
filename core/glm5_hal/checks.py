"""Input validation helpers shared by the op definitions.

Each helper raises `InvalidInputError(op, arg, expected, actual)`. They only look at
metadata (type, dim, shape, dtype, device, strides), so they also run on fake tensors
while tracing; data-dependent checks (index ranges) live in each op's `check_values`.
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


def same_dtype(op: str, ref_arg: str, ref: torch.Tensor, arg: str, t: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, arg, f"dtype {_name(ref.dtype)} (the dtype of '{ref_arg}')", _name(t.dtype))


def contiguous(op: str, arg: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        fail(op, arg, "a contiguous tensor", f"strides {list(t.stride())} for shape {list(t.shape)}")


def integer(op: str, arg: str, v: object, *, min_value: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail(op, arg, "an int", repr(v))
    if min_value is not None and v < min_value:
        fail(op, arg, f"an int >= {min_value}", v)
    return v


def number(op: str, arg: str, v: object, *, min_value: float | None = None,
           exclusive_min: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(op, arg, "a finite number", repr(v))
    if min_value is not None and (v <= min_value if exclusive_min else v < min_value):
        fail(op, arg, f"a number {'>' if exclusive_min else '>='} {min_value}", v)
    return float(v)


def choice(op: str, arg: str, v: object, options: Sequence[object]) -> None:
    if v not in options:
        fail(op, arg, f"one of {list(options)}", repr(v))


def index_range(op: str, arg: str, t: torch.Tensor, low: int, high: int, *,
                allow: Sequence[int] = ()) -> None:
    """Every element of `t` is in [low, high) or one of `allow` (data-dependent: eager only)."""
    if t.numel() == 0:
        return
    bad = (t < low) | (t >= high)
    for v in allow:
        bad &= t != v
    if bool(bad.any()):
        first = t[bad].flatten()[0].item()
        allowed = f" (or {', '.join(map(str, allow))})" if allow else ""
        fail(op, arg, f"values in [{low}, {high}){allowed}", f"{first} at flat index "
             f"{int(bad.flatten().nonzero()[0].item())}")
