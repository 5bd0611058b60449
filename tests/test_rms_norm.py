"""rms_norm: the cpu kernel against the reference, and the input contract."""
from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from glm5_hal.backends.cpu import common as cpu_common

from cpu_helpers import native_view

TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def check_close(out, x, w, eps):
    expected = hal.reference.rms_norm(x.double(), w.double(), eps)
    rtol, atol = TOL[x.dtype]
    assert out.dtype == x.dtype and out.shape == x.shape
    # one rounding of the output on top of fp32 accumulation
    torch.testing.assert_close(out.double(), expected.to(x.dtype).double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (129, 64), (2, 5, 6144), (0, 8)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_reference(dtype, shape, wdtype):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, wdtype)).encode()))
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(wdtype)
    with hal.use("cpu"):
        assert hal.explain("rms_norm", x, w, 1e-5).chosen == "cpu.rms_norm"
        out = hal.ops.rms_norm(x, w, 1e-5)
    check_close(out, x, w, 1e-5)


def test_non_contiguous_input_is_handled():
    x = torch.randn(64, 10).t()  # [10, 64] with row stride 1
    w = torch.randn(64)
    check_close(cpu_common.rms_norm(x, w, 1e-6), x, w, 1e-6)
    xs = torch.randn(8, 128)[:, ::2]  # strided last dim
    w2 = torch.randn(64)
    check_close(cpu_common.rms_norm(xs, w2, 1e-6), xs, w2, 1e-6)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), dim=st.integers(1, 300), dtype=st.sampled_from(list(TOL)),
       eps=st.floats(0, 1e-2), seed=st.integers(0, 2**31 - 1))
def test_property_cpu_equals_reference(rows, dim, dtype, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = torch.randn(dim, generator=g)
    check_close(cpu_common.rms_norm(x, w, eps), x, w, eps)


BAD = [
    (lambda x, w: (x.int(), w, 1e-5), "x", "dtype float32 or float16 or bfloat16"),
    (lambda x, w: (x, w[:-1], 1e-5), "weight", "shape [16]"),
    (lambda x, w: (x, w[None], 1e-5), "weight", "a 1-d tensor"),
    (lambda x, w: (x, w.to("meta"), 1e-5), "weight", "a tensor on cpu"),
    (lambda x, w: (x, w, -1.0), "eps", "a number >= 0.0"),
    (lambda x, w: (x, w, float("nan")), "eps", "a finite number"),
    (lambda x, w: (x.numpy(), w, 1e-5), "x", "a torch.Tensor"),
    (lambda x, w: (torch.empty(3, 0), torch.empty(0), 1e-5), "x", "a last dim >= 1"),
]


@pytest.mark.parametrize("make,arg,expected", BAD)
def test_bad_input_raises_invalid_input_error(make, arg, expected):
    x, w = torch.randn(4, 16), torch.randn(16)
    with pytest.raises(hal.InvalidInputError) as info:
        hal.ops.rms_norm(*make(x, w))
    err = info.value
    assert isinstance(err, ValueError) and err.op == "rms_norm" and err.arg == arg
    assert expected in str(err)


def test_native_kernel_rejects_inconsistent_sizes_itself():
    from glm5_hal import _C
    x = torch.randn(2, 8)
    w = x[0]
    # output rows must not overlap; input rows may (a row stride of 0 reads an expanded tensor)
    with pytest.raises(hal.InvalidInputError, match="row stride >= the row width 8"):
        _C.rms_norm(native_view(x, stride=(4, 1)), x, w, 1e-5, 1)
    with pytest.raises(hal.InvalidInputError, match="row stride >= 0"):
        _C.rms_norm(x, native_view(x, stride=(-8, 1)), w, 1e-5, 1)
    with pytest.raises(hal.InvalidInputError, match="dtype code 9"):
        _C.rms_norm(x, native_view(x, dtype=9), w, 1e-5, 1)
