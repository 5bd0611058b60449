"""Shared by tests/test_cpu_*.py: the native kernel tiers, the reference in float64, and the
tolerance of one output rounding on top of float32 accumulation."""
from __future__ import annotations

import contextlib

import pytest
import torch

import glm5_hal as hal
from glm5_hal import _C

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# (rtol, atol) of a float32-accumulated result rounded once to the dtype, against the float64
# reference rounded to the same dtype: at most one ulp apart (fp32: a few ulps of accumulation).
TOL = {torch.float32: (4e-6, 1e-5), torch.float16: (2e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
TIERS = tuple(range(_C.vec_max_isa() + 1))
TIER_NAMES = {0: "portable", 1: "avx2", 2: "avx512"}


@contextlib.contextmanager
def isa_limit(level: int, set_limit=None, current=None):
    """Caps a kernel family's tier (default: the row kernels') for the block; `current`, when
    given, must then report `level`."""
    set_limit = set_limit or _C.vec_set_isa_limit
    current = current if set_limit is not _C.vec_set_isa_limit else _C.vec_isa
    previous = set_limit(level)
    try:
        assert current is None or current() == level
        yield
    finally:
        set_limit(previous)


@pytest.fixture(params=TIERS, ids=lambda t: TIER_NAMES[t])
def tier(request):
    """Runs the test once per row-kernel tier this CPU has (portable, AVX2, AVX-512)."""
    with isa_limit(request.param):
        yield request.param


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


def upcast(a):
    if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float8_e4m3fn:
        return a.double()
    return a


def reference(op: str, *args):
    """The reference on float64-upcast inputs (as the conformance suite runs it)."""
    return getattr(hal.reference, op)(*[upcast(a) for a in args])


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, widen: float = 1.0):
    assert out.dtype == dtype, (out.dtype, dtype)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=rtol * widen, atol=atol * widen)


def cpu_impl(op: str):
    """The cpu backend's own function for `op` (no registry checks in front of it)."""
    return hal.get_backend("cpu").impls[op].fn


def chosen(op: str, *args) -> str:
    with hal.use("cpu"):
        return hal.explain(op, *args).chosen


def native_view(t: torch.Tensor, size=None, stride=None, dtype: int | None = None):
    """The glm5_hal._C.View a kernel receives for `t`, with any of size, stride and dtype (a
    glm5::DType code) replaced: geometry no tensor has, for the native checks' tests."""
    v = _C.View(t)
    return _C.View(data=v.data, dtype=v.dtype if dtype is None else dtype, size=v.size if size is None else size,
                   stride=v.stride if stride is None else stride)
