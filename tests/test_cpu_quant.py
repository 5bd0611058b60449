"""The cpu backend's quantization ops: native fp8_block_quant bit-exact against the reference
(codes and scales) on every tier, special values included; torch-backed INT4 ops and
w4a16_gemm against the reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from glm5_hal import InvalidInputError, _C

from cpu_helpers import (FLOATS, TIERS, assert_close, chosen, cpu_impl, gen, isa_limit, native_view,  # noqa: F401
                         reference, tier)

FP8 = torch.float8_e4m3fn


def assert_fp8_equal(got, want):
    (q, s), (rq, rs) = got, want
    assert q.dtype == FP8 and q.shape == rq.shape and s.shape == rs.shape and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("shape,block", [((3, 128), 128), ((2, 5, 384), 128), ((7, 6), 3), ((4, 1), 1), ((0, 256), 128)])
def test_fp8_block_quant_bit_exact(tier, dtype, scale_fmt, shape, block):
    g = gen("fp8", str(dtype), scale_fmt, shape, tier)
    x = (torch.randn(shape, generator=g) * 20).to(dtype)
    assert chosen("fp8_block_quant", x, block, scale_fmt) == "cpu.fp8_block_quant"
    assert_fp8_equal(hal.ops.fp8_block_quant(x, block, scale_fmt), hal.reference.fp8_block_quant(x, block, scale_fmt))


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_special_values(tier, scale_fmt):
    # subnormal e4m3 codes, ties, the 1e-4 amax floor, +-0, values that round to +-448
    rows = [[0.0, -0.0, 1e-9, -1e-9] * 4,
            [448.0, -448.0, 447.0, 440.0, 1.0, 2 ** -9, 2 ** -10, 3 * 2 ** -10] * 2,
            [1e30, -1e30, 1.0, -1.0] * 4,
            [float(i) * 1e-6 for i in range(16)]]
    x = torch.tensor(rows)
    assert_fp8_equal(hal.ops.fp8_block_quant(x, 4, scale_fmt), hal.reference.fp8_block_quant(x, 4, scale_fmt))
    assert_fp8_equal(hal.ops.fp8_block_quant(x, 16, scale_fmt), hal.reference.fp8_block_quant(x, 16, scale_fmt))


def test_fp8_nan_and_inf_stay_non_finite():
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0], [float("inf"), 1.0, 2.0, 3.0]])
    q, s = hal.ops.fp8_block_quant(x, 4)
    assert torch.isnan(q.float()[0, 0]) and torch.isnan(s[0, 0])
    assert not torch.isfinite(s[1, 0])


def test_fp8_non_contiguous_input():
    g = gen("fp8-views")
    for x in (torch.randn(256, 6, generator=g).t(), torch.randn(4, 512, generator=g)[:, ::2]):
        assert_fp8_equal(hal.ops.fp8_block_quant(x, 128), hal.reference.fp8_block_quant(x, 128))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 9), blocks=st.integers(1, 5), block=st.integers(1, 70), dtype=st.sampled_from(FLOATS),
       scale_fmt=st.sampled_from([None, "ue8m0"]), log_scale=st.integers(-12, 12), seed=st.integers(0, 2**31 - 1),
       tier_=st.sampled_from(TIERS))
def test_property_fp8_block_quant(rows, blocks, block, dtype, scale_fmt, log_scale, seed, tier_):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, blocks * block, generator=g) * 2.0 ** log_scale).to(dtype)
    with isa_limit(tier_):
        assert_fp8_equal(cpu_impl("fp8_block_quant")(x, block, scale_fmt),
                         hal.reference.fp8_block_quant(x, block, scale_fmt))


def test_native_fp8_rejects_bad_arguments():
    x = torch.randn(2, 8)
    q = torch.zeros(2, 8, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 2)
    v = native_view
    for args in [(x, 3), (x, 0), (v(x, size=(-2, 8)), 4), (v(x, stride=(-8, 1)), 4), (v(x, dtype=3), 4)]:
        with pytest.raises(InvalidInputError):
            _C.fp8_block_quant(q, s, *args, False, 1)
    assert (q.view(torch.uint8) == 0).all() and (s == 0).all()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_int4_ops_and_w4a16_match_reference(dtype):
    g = gen("int4", str(dtype))
    w = torch.randn(24, 64, generator=g).to(dtype)
    for op, args in [("int4_fake_quant", (w, 16)), ("int4_pack", (w, 32))]:
        assert chosen(op, *args) == f"cpu.{op}"
        got, want = getattr(hal.ops, op)(*args), getattr(hal.reference, op)(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b)
    packed, scale = hal.ops.int4_pack(w, 32)
    assert chosen("int4_unpack", packed, scale, 32) == "cpu.int4_unpack"
    assert torch.equal(hal.ops.int4_unpack(packed, scale, 32), hal.reference.int4_unpack(packed, scale, 32))
    x = torch.randn(5, 64, generator=g).to(dtype)
    assert chosen("w4a16_gemm", x, packed, scale, 32) == "cpu.w4a16_gemm"
    assert_close(hal.ops.w4a16_gemm(x, packed, scale, 32), reference("w4a16_gemm", x, packed, scale, 32), dtype,
                 widen=4)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 9), groups=st.integers(1, 4), group=st.sampled_from([1, 2, 3, 8, 16, 24, 128]),
       dtype=st.sampled_from(FLOATS), log_scale=st.integers(-20, 10), seed=st.integers(0, 2**31 - 1),
       tier_=st.sampled_from(TIERS))
def test_property_int4_native_bit_exact(n, groups, group, dtype, log_scale, seed, tier_):
    g = torch.Generator().manual_seed(seed)
    k = groups * group
    w = (torch.randn(n, k, generator=g) * 2.0 ** log_scale).to(dtype)
    with isa_limit(tier_):
        assert torch.equal(cpu_impl("int4_fake_quant")(w, group), hal.reference.int4_fake_quant(w, group))
        if k % 8 == 0:
            packed, scale = cpu_impl("int4_pack")(w, group)
            rp, rs = hal.reference.int4_pack(w, group)
            assert torch.equal(packed, rp) and torch.equal(scale, rs)
            assert torch.equal(cpu_impl("int4_unpack")(packed, scale, group), hal.reference.int4_unpack(rp, rs, group))


def test_int4_non_contiguous_and_nan():
    g = gen("int4-views")
    w = torch.randn(64, 12, generator=g).t()                 # [12, 64], column-major
    assert torch.equal(hal.ops.int4_fake_quant(w, 16), hal.reference.int4_fake_quant(w, 16))
    packed, scale = hal.ops.int4_pack(w, 32)
    assert torch.equal(packed, hal.reference.int4_pack(w, 32)[0])
    wide = torch.randint(-2**31, 2**31 - 1, (3, 8), generator=g, dtype=torch.int32)[:, ::2]
    s = torch.rand(3, 2, generator=g)
    assert torch.equal(hal.ops.int4_unpack(wide, s, 16), hal.reference.int4_unpack(wide, s, 16))
    bad = torch.ones(2, 16)
    bad[0, 3] = float("nan")
    out = hal.ops.int4_fake_quant(bad, 8)                     # a defined result, no crash
    assert torch.isnan(out[0, :8]).all() and torch.equal(out[1], torch.ones(16))


def test_native_int4_rejects_bad_arguments():
    w = torch.randn(2, 16)
    packed = torch.zeros(2, 2, dtype=torch.int32)
    scale = torch.zeros(2, 2)
    out = torch.zeros(2, 16)
    v = native_view
    for args in [(w, 3), (w, 0), (v(w, size=(2, 12)), 4), (v(w, stride=(-1, 1)), 8), (v(w, dtype=4), 8)]:
        with pytest.raises(InvalidInputError):
            _C.int4_quantize(None, packed, scale, *args, 1)
    with pytest.raises(InvalidInputError, match="at least one output"):
        _C.int4_quantize(None, None, None, w, 8, 1)
    for args in [(packed, 3), (packed, 0), (v(packed, stride=(-2, 1)), 8), (v(packed, size=(-1, 2)), 8)]:
        with pytest.raises(InvalidInputError):
            _C.int4_unpack(out, args[0], scale, args[1], 1)
    assert (packed == 0).all() and (scale == 0).all() and (out == 0).all()
