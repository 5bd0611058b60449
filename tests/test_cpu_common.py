"""The cpu backend's native elementwise kernels (rms_norm, silu_and_mul, apply_rope,
hadamard_transform) against the float64 reference, on every row-kernel tier of this CPU."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from glm5_hal import InvalidInputError

from cpu_helpers import (FLOATS, TIERS, assert_close, chosen, cpu_impl, gen, isa_limit, native_view,  # noqa: F401
                         reference, tier)

ODD_WIDTHS = (1, 3, 17, 64, 129, 300)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("width", ODD_WIDTHS)
def test_rms_norm_every_tier(tier, dtype, width):
    g = gen("rms", width, str(dtype), tier)
    x = (torch.randn(7, width, generator=g) * 3).to(dtype)
    w = (torch.rand(width, generator=g) + 0.5).to(dtype)
    assert chosen("rms_norm", x, w, 1e-5) == "cpu.rms_norm"
    assert_close(hal.ops.rms_norm(x, w, 1e-5), reference("rms_norm", x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", ODD_WIDTHS)
def test_silu_and_mul_every_tier(tier, dtype, n):
    g = gen("silu", n, str(dtype), tier)
    x = (torch.randn(2, 5, 2 * n, generator=g) * 4).to(dtype)
    assert chosen("silu_and_mul", x) == "cpu.silu_and_mul"
    assert_close(hal.ops.silu_and_mul(x), reference("silu_and_mul", x), dtype, widen=2)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_silu_and_mul_extremes(tier, dtype):
    # exp(-g) overflows for g << 0 and underflows for g >> 0: results stay finite and exact-ish
    big = 60000.0 if dtype == torch.float16 else 1e30
    gate = torch.tensor([-big, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 100.0, big]).to(dtype)
    x = torch.cat([gate, torch.full_like(gate, 0.5)])[None]
    out = hal.ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    assert_close(out, reference("silu_and_mul", x), dtype, widen=2)


def test_silu_and_mul_propagates_nan():
    x = torch.tensor([[float("nan"), 1.0, 2.0, float("nan")]])
    out = hal.ops.silu_and_mul(x)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
def test_apply_rope_every_tier(tier, dtype, interleaved, pos_dtype):
    g = gen("rope", str(dtype), interleaved, tier)
    for tokens, heads, rot in ((1, 1, 2), (5, 3, 64), (17, 2, 6), (3, 64, 64)):
        x = torch.randn(tokens, heads, rot, generator=g).to(dtype)
        # large positions (GLM-5 has 202752) and negative ones (the backward rotates by -pos)
        pos = torch.randint(-202752, 202752, (tokens,), generator=g).to(pos_dtype)
        assert chosen("apply_rope", x, pos, 1e6, interleaved) == "cpu.apply_rope"
        assert_close(hal.ops.apply_rope(x, pos, 1e6, interleaved),
                     reference("apply_rope", x, pos, 1e6, interleaved), dtype, widen=2)


def test_apply_rope_non_contiguous_and_empty():
    g = gen("rope-views")
    base = torch.randn(6, 4, 128, generator=g)
    x = base[:, :, 64:]                       # the rope slice of a wider head
    pos = torch.arange(0, 12, 2)[::2].repeat(2)  # strided positions
    assert_close(hal.ops.apply_rope(x, pos, 1e4, True), reference("apply_rope", x, pos, 1e4, True), torch.float32)
    xt = torch.randn(3, 8, 16, generator=g).transpose(0, 1)  # [8, 3, 16], token stride 16
    p = torch.arange(8)
    assert_close(hal.ops.apply_rope(xt, p, 1e6, False), reference("apply_rope", xt, p, 1e6, False), torch.float32)
    e = torch.randn(0, 4, 8)
    assert hal.ops.apply_rope(e, torch.zeros(0, dtype=torch.int64), 1e6, True).shape == (0, 4, 8)


def test_apply_rope_preserves_pair_norms():
    x = torch.randn(4, 2, 64, generator=gen("rope-norm"), dtype=torch.float32)
    out = hal.ops.apply_rope(x, torch.tensor([0, 7, 1000, 202751]), 1e6, True)
    torch.testing.assert_close(out.view(4, 2, 32, 2).norm(dim=-1), x.view(4, 2, 32, 2).norm(dim=-1))
    torch.testing.assert_close(out[0], x[0])  # position 0: identity


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dim", [1, 2, 4, 8, 16, 128, 1024])
def test_hadamard_every_tier(tier, dtype, dim):
    g = gen("hadamard", dim, str(dtype), tier)
    x = torch.randn(3, 5, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    assert chosen("hadamard_transform", x, scale) == "cpu.hadamard_transform"
    assert_close(hal.ops.hadamard_transform(x, scale), reference("hadamard_transform", x, scale), dtype,
                 widen=1 + math.log2(dim))


def test_hadamard_is_an_involution_when_orthonormal():
    x = torch.randn(9, 128, generator=gen("hadamard-inv"), dtype=torch.float32)
    twice = hal.ops.hadamard_transform(hal.ops.hadamard_transform(x, 128 ** -0.5), 128 ** -0.5)
    torch.testing.assert_close(twice, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "hadamard_transform"])
def test_non_contiguous_rows(op):
    g = gen("views", op)
    views = [torch.randn(16, 10, generator=g).t(),            # row stride 1
             torch.randn(6, 64, generator=g)[:, ::2],          # strided last dim
             torch.randn(6, 40, generator=g)[:, :32],          # row slice
             torch.randn(1, 32, generator=g).expand(5, 32)]    # row stride 0
    for x in views:
        args = {"rms_norm": (x, torch.rand(x.shape[-1], generator=g) + 0.5, 1e-6),
                "silu_and_mul": (x,), "hadamard_transform": (x, 0.5)}[op]
        if op == "hadamard_transform" and x.shape[-1] & (x.shape[-1] - 1):
            continue
        assert_close(getattr(hal.ops, op)(*args), reference(op, *args), torch.float32, widen=4)


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "hadamard_transform"])
def test_empty_batch(op):
    x = torch.randn(0, 3, 8)
    args = {"rms_norm": (x, torch.ones(8), 1e-6), "silu_and_mul": (x,), "hadamard_transform": (x, 1.0)}[op]
    out = getattr(hal.ops, op)(*args)
    assert out.shape == reference(op, *args).shape


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 12), half=st.integers(1, 70), dtype=st.sampled_from(FLOATS),
       tier_=st.sampled_from(TIERS), seed=st.integers(0, 2**31 - 1))
def test_property_silu_hadamard_rope(rows, half, dtype, tier_, seed):
    g = torch.Generator().manual_seed(seed)
    with isa_limit(tier_):
        x = (torch.randn(rows, 2 * half, generator=g) * 5).to(dtype)
        assert_close(cpu_impl("silu_and_mul")(x), reference("silu_and_mul", x), dtype, widen=2)
        d = 1 << (half % 9)
        xh = torch.randn(rows, d, generator=g).to(dtype)
        assert_close(cpu_impl("hadamard_transform")(xh, 0.25), reference("hadamard_transform", xh, 0.25), dtype,
                     widen=1 + math.log2(d))
        xr = torch.randn(rows, 2, 2 * half, generator=g).to(dtype)
        pos = torch.randint(-5000, 5000, (rows,), generator=g)
        for inter in (True, False):
            assert_close(cpu_impl("apply_rope")(xr, pos, 1e4, inter), reference("apply_rope", xr, pos, 1e4, inter),
                         dtype, widen=2)


def test_native_checks_reject_bad_arguments():
    from glm5_hal import _C
    x = torch.randn(4, 8)
    out = torch.full((4, 8), 7.0)
    w, pos = x[0], torch.arange(4)
    v = native_view
    calls = [
        lambda: _C.rms_norm(out, v(x, size=(-1, 8)), w, 1e-5, 1),                                     # rows < 0
        lambda: _C.rms_norm(out, v(x, size=(4, 0)), w, 1e-5, 1),                                      # dim 0
        lambda: _C.rms_norm(v(out, stride=(4, 1)), x, w, 1e-5, 1),                                    # out rows overlap
        lambda: _C.rms_norm(out, v(x, dtype=9), w, 1e-5, 1),                                          # dtype code
        lambda: _C.rms_norm(out, x, w, -1.0, 1),                                                      # eps < 0
        lambda: _C.silu_and_mul(v(out, size=(4, 0)), v(x, size=(4, 0)), 1),                          # n = 0
        lambda: _C.silu_and_mul(v(out, size=(4, 4)), v(x, stride=(-8, 1)), 1),                       # stride < 0
        lambda: _C.silu_and_mul(v(out, size=(4, 4)), v(x, dtype=4), 1),                               # int dtype
        lambda: _C.hadamard_transform(v(out, size=(4, 6)), v(x, size=(4, 6)), 1.0, 1),                # not 2^k
        lambda: _C.hadamard_transform(out, x, float("inf"), 1),                                       # scale
        lambda: _C.apply_rope(v(out, size=(4, 1, 7), stride=(8, 8, 1)), v(x, size=(4, 1, 7), stride=(8, 8, 1)),
                              pos, 1e4, True, 1),                                                     # odd R
        lambda: _C.apply_rope(out.view(4, 1, 8), x.view(4, 1, 8), v(pos, dtype=0), 1e4, True, 1),     # positions dtype
        lambda: _C.apply_rope(out.view(4, 1, 8), x.view(4, 1, 8), pos, 0.0, True, 1),                 # theta
        lambda: _C.apply_rope(v(out, size=(4, 2, 4), stride=(4, 4, 1)), x.view(4, 2, 4), pos, 1e4, True, 1),
    ]
    for call in calls:
        with pytest.raises(InvalidInputError):
            call()
        assert (out == 7.0).all()  # nothing written
