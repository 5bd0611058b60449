"""fp8_block_quant and the INT4 ops (docs/ops/quant.md): the formats pinned by independent
formulations and hand-built examples, round-trip bounds, the straight-through gradient,
the input contract, opcheck and torch.compile."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal

from conftest import REPO, assert_invalid, seeded

FP8 = torch.float8_e4m3fn
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Tensor bits as integers, so that equality is bit-exact (signed zeros included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# -- fp8_block_quant -------------------------------------------------------------------------

def e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, enumerated from its 256 bit patterns."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).double()
    return values[values.isfinite()].unique()


def reference_scales(x: torch.Tensor, block: int) -> list[float]:
    """Per-block max(amax, 1e-4) / 448, one Python float per block, row-major."""
    rows = x.double().reshape(-1, x.shape[-1])
    return [max(rows[r, b:b + block].abs().max().item(), 1e-4) / 448
            for r in range(rows.shape[0]) for b in range(0, x.shape[-1], block)]


def check_nearest_e4m3(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, block: int):
    """Each q is a nearest e4m3 value to x / scale (clamped to +-448)."""
    y = (x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block) / scale.unsqueeze(-1)).clamp(-448, 448).double().flatten()
    grid = e4m3_grid()
    best = (grid[None, :] - y[:, None]).abs().min(dim=1).values
    got = (q.double().flatten() - y).abs()
    assert bool((got <= best).all()), f"not a nearest e4m3 value at {int((got > best).nonzero()[0])}"


def check_fp8_round_trip_bound(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, block: int):
    """|q * s - x| <= max(2^-4 |x|, 2^-10 s): half an e4m3 ulp (3 mantissa bits) of a normal
    value, half the subnormal spacing 2^-9 below 2^-6, plus float32 rounding slack."""
    s = scale.repeat_interleave(block, dim=-1)
    xf = x.float()
    err = (q.float() * s - xf).abs()
    bound = torch.maximum(xf.abs() * 2 ** -4, s * 2 ** -10) * (1 + 1e-5)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,block", [((3, 256), 128), ((2, 3, 64), 16), ((5, 7), 7), ((4, 9), 1), ((0, 128), 128)])
def test_fp8_scales_and_round_trip(dtype, shape, block):
    x = (torch.randn(shape, generator=seeded(1)) * torch.logspace(-6, 3, shape[-1])).to(dtype)
    q, scale = hal.ops.fp8_block_quant(x, block, None)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (*shape[:-1], shape[-1] // block)
    assert scale.flatten().tolist() == pytest.approx(reference_scales(x, block), rel=2e-7)
    check_nearest_e4m3(q, scale, x, block)
    check_fp8_round_trip_bound(q, scale, x, block)
    # the largest element of a block lands on +-448 exactly, unless the amax floor applies
    blocks = (*shape[:-1], shape[-1] // block, block)
    qmax, amax = q.float().abs().reshape(blocks).amax(dim=-1), x.float().abs().reshape(blocks).amax(dim=-1)
    assert bool((qmax[amax >= 1e-4] == 448).all())
    assert bool((qmax[amax < 1e-4] < 448).all())


@pytest.mark.parametrize("shape,block", [((3, 256), 128), ((2, 3, 48), 16)])
def test_fp8_ue8m0_scales_are_powers_of_two_covering_amax(shape, block):
    x = torch.randn(shape, generator=seeded(2)) * 37
    q, scale = hal.ops.fp8_block_quant(x, block, "ue8m0")
    assert bool((torch.frexp(scale).mantissa == 0.5).all())  # exactly 2^e
    plain = torch.tensor(reference_scales(x, block), dtype=torch.float64).reshape(scale.shape)
    assert bool((scale.double() >= plain).all()) and bool((scale.double() < 2 * plain).all())
    check_nearest_e4m3(q, scale, x, block)
    check_fp8_round_trip_bound(q, scale, x, block)


def test_fp8_rounds_to_nearest_even_including_subnormals():
    # amax 448 gives scale 1 exactly, so q = x: midpoints must round to the even mantissa
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 2 ** -10, 3 * 2 ** -10, 0.0, 240.0]])
    q, scale = hal.ops.fp8_block_quant(x, 8, None)
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, -1.0, 0.0, 2 ** -8, 0.0, 240.0]]


def test_fp8_all_zero_block_uses_the_amax_floor():
    x = torch.zeros(2, 32)
    x[1, 16:] = 1.0
    q, scale = hal.ops.fp8_block_quant(x, 16, None)
    assert scale[0].tolist() == [pytest.approx(1e-4 / 448, rel=1e-7)] * 2
    assert float(scale[1, 1]) == pytest.approx(1 / 448, rel=1e-7)
    assert bool((q[0].float() == 0).all()) and bool((q[1, 16:].float() == 448).all())


def test_fp8_half_precision_input_quantizes_its_float32_value():
    x = torch.randn(4, 64, generator=seeded(3)).bfloat16()
    q, s = hal.ops.fp8_block_quant(x, 32, "ue8m0")
    q32, s32 = hal.ops.fp8_block_quant(x.float(), 32, "ue8m0")
    assert torch.equal(as_bits(q), as_bits(q32)) and torch.equal(s, s32)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(rows=st.integers(0, 4), blocks=st.integers(1, 4), block=st.integers(1, 40),
       fmt=st.sampled_from([None, "ue8m0"]), magnitude=st.floats(-8, 4), seed=st.integers(0, 2**31 - 1))
def test_property_fp8_nearest_value_and_bound(rows, blocks, block, fmt, magnitude, seed):
    x = torch.randn(rows, blocks * block, generator=seeded(seed)) * 10 ** magnitude
    q, scale = hal.ops.fp8_block_quant(x, block, fmt)
    check_nearest_e4m3(q, scale, x, block)
    check_fp8_round_trip_bound(q, scale, x, block)


# -- INT4 ------------------------------------------------------------------------------------

def int4_scales(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """max(amax / 7, 1e-5) per group, group by group in Python."""
    n, k = w.shape
    return torch.tensor([[max(w[r, g:g + group_size].float().abs().max().item() / 7, 1e-5)
                          for g in range(0, k, group_size)] for r in range(n)],
                        dtype=torch.float64).reshape(n, k // group_size)


def check_int4_round_trip(w: torch.Tensor, group_size: int):
    packed, scale = hal.ops.int4_pack(w, group_size)
    assert packed.dtype == torch.int32 and packed.shape == (w.shape[0], w.shape[1] // 8)
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0], w.shape[1] // group_size)
    torch.testing.assert_close(scale.double(), int4_scales(w, group_size), rtol=2e-7, atol=0)
    unpacked = hal.ops.int4_unpack(packed, scale, group_size)
    fake = hal.ops.int4_fake_quant(w, group_size)
    assert unpacked.dtype == torch.float32 and fake.dtype == w.dtype
    assert torch.equal(as_bits(unpacked.to(w.dtype)), as_bits(fake))
    # no nibble is ever 0 (q = -8 is outside the symmetric grid)
    nibbles = (packed.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    assert bool((nibbles >= 1).all())
    s = scale.repeat_interleave(group_size, dim=1)
    err = (unpacked - w.float()).abs()
    assert bool((err <= s / 2 * (1 + 1e-6)).all()), f"max error / scale {(err / s).max().item()}"
    return packed, scale


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,group_size", [((3, 256), 128), ((5, 64), 32), ((2, 24), 3), ((1, 8), 8),
                                              ((4, 16), 1), ((0, 32), 32)])
def test_int4_pack_unpack_equals_fake_quant_bit_exactly(dtype, shape, group_size):
    w = (torch.randn(shape, generator=seeded(4)) * torch.logspace(-6, 1, shape[1])).to(dtype)
    check_int4_round_trip(w, group_size)


def test_int4_pack_layout_on_a_hand_built_example():
    # amax 7 per group gives scale 1 (0.5 for the halved second group), so q is the weight
    row0 = torch.tensor([7.0, -7, 0, 1, 2, 3, -1, 6])   # u = F 1 8 9 A B 7 E, bit 31 set
    row1 = torch.tensor([1.0, 2, 3, 4, 5, 6, 7, -1])    # u = 9 A B C D E F 7
    w = torch.stack([torch.cat([row0, row0 / 2]), torch.cat([row1, row1 / 2])])
    packed, scale = hal.ops.int4_pack(w, 8)
    word0, word1 = 0xE7BA981F - 2 ** 32, 0x7FEDCBA9
    assert packed.tolist() == [[word0, word0], [word1, word1]]
    assert scale.tolist() == [[1.0, 0.5], [1.0, 0.5]]
    assert torch.equal(hal.ops.int4_unpack(packed, scale, 8), w)


def test_int4_unpack_reads_every_nibble_of_foreign_words():
    packed = torch.tensor([[-1, 0, -2 ** 31, 0x12345678]], dtype=torch.int32)
    out = hal.ops.int4_unpack(packed, torch.tensor([[2.0]]), 32)
    q = [7] * 8 + [-8] * 8 + [-8] * 7 + [0] + [0, -1, -2, -3, -4, -5, -6, -7]
    assert out.tolist() == [[2.0 * v for v in q]]


def test_int4_rounds_half_to_even_and_zero_groups_get_the_scale_floor():
    w = torch.tensor([[7.0, 2.5, 3.5, -0.5, 0.5, -2.5, 1.5, -7.0], [0.0] * 8])
    assert hal.ops.int4_fake_quant(w, 8).tolist() == [[7.0, 2.0, 4.0, 0.0, 0.0, -2.0, 2.0, -7.0], [0.0] * 8]
    _, scale = hal.ops.int4_pack(w, 8)
    assert scale.tolist() == [[1.0], [pytest.approx(1e-5, rel=1e-7)]]


def test_int4_fake_quant_has_no_negative_zeros():
    w = torch.tensor([[-0.1, 7.0, -0.4, 0.0]])
    assert torch.equal(as_bits(hal.ops.int4_fake_quant(w, 4)), as_bits(torch.tensor([[0.0, 7.0, 0.0, 0.0]])))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(0, 5), words=st.integers(1, 12), dtype=st.sampled_from(FLOATS), data=st.data(),
       magnitude=st.floats(-6, 3), seed=st.integers(0, 2**31 - 1))
def test_property_int4_round_trip(n, words, dtype, data, magnitude, seed):
    k = 8 * words
    group_size = data.draw(st.sampled_from([d for d in range(1, k + 1) if k % d == 0]))
    w = (torch.randn(n, k, generator=seeded(seed)) * 10 ** magnitude).to(dtype)
    check_int4_round_trip(w, group_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_fake_quant_gradient_is_straight_through(dtype):
    w = torch.randn(6, 64, generator=seeded(5)).to(dtype).requires_grad_()
    upstream = torch.randn(6, 64, generator=seeded(6)).to(dtype)
    hal.ops.int4_fake_quant(w, 16).backward(upstream)
    assert torch.equal(w.grad, upstream)


def test_int4_fake_quant_gradient_is_straight_through_under_compile():
    torch._dynamo.reset()
    w = torch.randn(6, 64, generator=seeded(7)).requires_grad_()
    upstream = torch.randn(6, 64, generator=seeded(8))
    compiled = torch.compile(lambda t: hal.ops.int4_fake_quant(t, 32) * 3.0, fullgraph=True)
    out = compiled(w)
    torch.testing.assert_close(out, hal.ops.int4_fake_quant(w.detach(), 32) * 3.0, rtol=0, atol=0)
    out.backward(upstream)
    torch.testing.assert_close(w.grad, upstream * 3.0, rtol=0, atol=0)


# -- w4a16_gemm ------------------------------------------------------------------------------

def packed_weight(n: int, k: int, group_size: int, seed: int):
    w = torch.randn(n, k, generator=seeded(seed))
    packed, scale = hal.ops.int4_pack(w, group_size)
    return packed, scale, hal.ops.int4_fake_quant(w, group_size)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("m,n,k,group_size", [(1, 1, 8, 8), (5, 17, 64, 32), (3, 40, 256, 128), (0, 4, 16, 16),
                                              (4, 0, 16, 8)])
def test_w4a16_gemm_is_x_times_dequantized_weight_transposed(dtype, m, n, k, group_size):
    packed, scale, weight = packed_weight(n, k, group_size, 9)
    x = torch.randn(m, k, generator=seeded(10)).to(dtype)
    out = hal.ops.w4a16_gemm(x, packed, scale, group_size)
    assert out.dtype == dtype and out.shape == (m, n)
    exact = x.double() @ weight.double().T
    rtol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}[dtype]
    # one rounding of the output on top of float32 accumulation over K terms
    torch.testing.assert_close(out.double(), exact.to(dtype).double(), rtol=rtol, atol=1e-5 * k)


def test_w4a16_gemm_gradients_for_x_and_scale():
    packed, scale, _ = packed_weight(12, 64, 16, 11)
    x = torch.randn(5, 64, generator=seeded(12)).requires_grad_()
    s = scale.clone().requires_grad_()
    upstream = torch.randn(5, 12, generator=seeded(13))
    hal.ops.w4a16_gemm(x, packed, s, 16).backward(upstream)
    # the same product written with explicit q and per-group scales, differentiated in float64
    q = hal.ops.int4_unpack(packed, torch.ones_like(scale), 16).double()
    xd, sd = x.detach().double().requires_grad_(), scale.double().requires_grad_()
    (xd @ (q * sd.repeat_interleave(16, dim=1)).T).backward(upstream.double())
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.grad.double(), sd.grad, rtol=1e-5, atol=1e-5)


# -- input contract --------------------------------------------------------------------------

W = lambda: torch.randn(4, 32)  # noqa: E731


def packed_args(n=4, k=32, group_size=16):
    packed, scale = hal.ops.int4_pack(torch.randn(n, k, generator=seeded(14)), group_size)
    return packed, scale


BAD = [
    ("fp8_block_quant", lambda: (W().numpy(), 16, None), "x", "a torch.Tensor"),
    ("fp8_block_quant", lambda: (torch.tensor(1.0), 1, None), "x", "at least 1 dims"),
    ("fp8_block_quant", lambda: (W().double(), 16, None), "x", "dtype float32 or float16 or bfloat16"),
    ("fp8_block_quant", lambda: (W(), 0, None), "block", "an int >= 1"),
    ("fp8_block_quant", lambda: (W(), 16.0, None), "block", "an int"),
    ("fp8_block_quant", lambda: (W(), True, None), "block", "an int"),
    ("fp8_block_quant", lambda: (W(), 12, None), "block", "a divisor of K = 32"),
    ("fp8_block_quant", lambda: (W(), 16, "e8m0"), "scale_fmt", "one of [None, 'ue8m0']"),
    ("int4_fake_quant", lambda: (W()[0], 8), "w", "a 2-d tensor"),
    ("int4_fake_quant", lambda: (W()[None], 8), "w", "a 2-d tensor"),
    ("int4_fake_quant", lambda: (W().to(FP8), 8), "w", "dtype float32"),
    ("int4_fake_quant", lambda: (W(), 0), "group_size", "an int >= 1"),
    ("int4_fake_quant", lambda: (W(), 8.0), "group_size", "an int"),
    ("int4_fake_quant", lambda: (W(), 5), "group_size", "a divisor of K = 32"),
    ("int4_pack", lambda: (torch.randn(4, 12), 4), "w", "a last dim K divisible by 8"),
    ("int4_pack", lambda: (W().int(), 8), "w", "dtype float32"),
    ("int4_pack", lambda: (W(), 64), "group_size", "a divisor of K = 32"),
    ("int4_pack", lambda: (W(), -8), "group_size", "an int >= 1"),
    ("int4_unpack", lambda: (packed_args()[0].long(), packed_args()[1], 16), "packed", "dtype int32"),
    ("int4_unpack", lambda: (packed_args()[0].flatten(), packed_args()[1], 16), "packed", "a 2-d tensor"),
    ("int4_unpack", lambda: (*packed_args(), 0), "group_size", "an int >= 1"),
    ("int4_unpack", lambda: (*packed_args(), 5), "group_size", "a divisor of K = 32"),
    ("int4_unpack", lambda: (*packed_args(), 8), "scale", "shape [4, 4]"),
    ("int4_unpack", lambda: (packed_args()[0], packed_args()[1].bfloat16(), 16), "scale", "dtype float32"),
    ("int4_unpack", lambda: (packed_args()[0], packed_args()[1][None], 16), "scale", "a 2-d tensor"),
    ("int4_unpack", lambda: (packed_args()[0], packed_args()[1][:3], 16), "scale", "shape [4, 2]"),
    ("int4_unpack", lambda: (packed_args()[0], packed_args()[1].to("meta"), 16), "scale", "a tensor on cpu"),
    ("w4a16_gemm", lambda: (torch.randn(2, 3, 32), *packed_args(), 16), "x", "a 2-d tensor"),
    ("w4a16_gemm", lambda: (torch.randn(2, 32).double(), *packed_args(), 16), "x", "dtype float32"),
    ("w4a16_gemm", lambda: (torch.randn(2, 30), *packed_args(), 16), "x", "a last dim K divisible by 8"),
    ("w4a16_gemm", lambda: (torch.randn(2, 64), *packed_args(), 16), "packed", "shape [*, 8]"),
    ("w4a16_gemm", lambda: (torch.randn(2, 32), packed_args()[0].float(), packed_args()[1], 16), "packed",
     "dtype int32"),
    ("w4a16_gemm", lambda: (torch.randn(2, 32), *packed_args(), 32), "scale", "shape [4, 1]"),
    ("w4a16_gemm", lambda: (torch.randn(2, 32), *packed_args(), 3), "group_size", "a divisor of K = 32"),
    ("w4a16_gemm", lambda: (torch.randn(2, 32), *packed_args(), None), "group_size", "an int"),
    ("w4a16_gemm", lambda: (torch.randn(2, 32), packed_args()[0].to("meta"), packed_args()[1], 16), "packed",
     "a tensor on cpu"),
]


@pytest.mark.parametrize("op,make,arg,expected", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_invalid_input_error(op, make, arg, expected):
    assert_invalid(getattr(hal.ops, op), make(), op, arg, expected)


def test_public_defaults():
    x = torch.randn(2, 256, generator=seeded(15))
    q, scale = hal.ops.fp8_block_quant(x)
    assert scale.shape == (2, 2) and not bool((torch.frexp(scale).mantissa == 0.5).all())


# -- opcheck, torch.compile ------------------------------------------------------------------

def opcheck_cases():
    g = seeded(16)
    x = torch.randn(3, 64, generator=g)
    packed, scale = hal.ops.int4_pack(torch.randn(6, 64, generator=g), 16)
    return {
        "fp8_block_quant": (x, 32, None),
        "fp8_block_quant_ue8m0": (x.bfloat16(), 16, "ue8m0"),
        "int4_fake_quant": (x, 16),
        "int4_pack": (x.half(), 32),
        "int4_unpack": (packed, scale, 16),
        "w4a16_gemm": (x.bfloat16(), packed, scale, 16),
    }


DIFFERENTIABLE = {"int4_fake_quant", "w4a16_gemm"}


@pytest.mark.parametrize("case", list(opcheck_cases()))
def test_opcheck(case):
    args = opcheck_cases()[case]
    name = case.removesuffix("_ue8m0")
    torch_op = getattr(torch.ops.glm5_hal, name).default
    torch.library.opcheck(torch_op, args)
    if name in DIFFERENTIABLE:
        torch.library.opcheck(torch_op, (args[0].clone().requires_grad_(), *args[1:]))


@pytest.mark.parametrize("case", list(opcheck_cases()))
def test_compile_fullgraph(case):
    torch._dynamo.reset()
    args = opcheck_cases()[case]
    op = getattr(hal.ops, case.removesuffix("_ue8m0"))
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    got, expected = compiled(*args), op(*args)
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(as_bits(g), as_bits(e))


def test_compiled_gemm_backward_matches_eager():
    torch._dynamo.reset()
    packed, scale, _ = packed_weight(8, 32, 8, 17)
    x1 = torch.randn(3, 32, generator=seeded(18)).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    compiled = torch.compile(lambda x: hal.ops.w4a16_gemm(x, packed, scale, 8).square().sum(), fullgraph=True)
    compiled(x1).backward()
    hal.ops.w4a16_gemm(x2, packed, scale, 8).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)


# -- docs ------------------------------------------------------------------------------------

def test_docs_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "ops" / "quant.md").read_text(), flags=re.S)
    assert len(blocks) >= 5  # one per op
    for block in blocks:
        exec(compile(block, "docs/ops/quant.md", "exec"), {})


def test_references_create_nothing_off_the_input_device():
    # meta tensors fail on any mix with a tensor made on the CPU: a cheap stand-in for a GPU
    meta = torch.device("meta")
    x = torch.empty(4, 32, device=meta)
    q, scale = hal.reference.fp8_block_quant(x, 16, "ue8m0")
    assert (q.device, q.dtype, scale.device, scale.shape) == (meta, FP8, meta, (4, 2))
    assert hal.reference.int4_fake_quant(x, 8).device == meta
    packed, scale = hal.reference.int4_pack(x, 8)
    assert (packed.device, packed.dtype, packed.shape) == (meta, torch.int32, (4, 4))
    assert hal.reference.int4_unpack(packed, scale, 8).shape == (4, 32)
    assert hal.reference.w4a16_gemm(torch.empty(2, 32, device=meta), packed, scale, 8).shape == (2, 4)


def test_non_contiguous_inputs_give_the_contiguous_result():
    g = seeded(19)
    wt = torch.randn(64, 6, generator=g).T  # [6, 64] with row stride 1
    assert not wt.is_contiguous()
    for got, expected in ((hal.ops.fp8_block_quant(wt, 16, None), hal.ops.fp8_block_quant(wt.contiguous(), 16, None)),
                          (hal.ops.int4_pack(wt, 16), hal.ops.int4_pack(wt.contiguous(), 16)),
                          ((hal.ops.int4_fake_quant(wt, 8),), (hal.ops.int4_fake_quant(wt.contiguous(), 8),))):
        for a, b in zip(got, expected):
            assert torch.equal(as_bits(a), as_bits(b))
    packed, scale = hal.ops.int4_pack(wt.contiguous(), 16)
    packed_t, scale_t = packed.T.contiguous().T, scale.T.contiguous().T
    x = torch.randn(64, 3, generator=g).T
    # the matmul may sum in another order for another layout: equal up to float32 rounding
    torch.testing.assert_close(hal.ops.w4a16_gemm(x, packed_t, scale_t, 16),
                               hal.ops.w4a16_gemm(x.contiguous(), packed, scale, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hal.ops.int4_unpack(packed_t, scale_t, 16), hal.ops.int4_unpack(packed, scale, 16),
                               rtol=0, atol=0)
