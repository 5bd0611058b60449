"""The GEMMs on the checkpoint formats and int8_quant (docs/ops/quant.md): their meaning pinned
by hand-built examples and independent formulations (dequantize, then multiply in float64;
exact integer sums), the grouped forms against the dense ones, round-trip bounds, the input
contract, opcheck and torch.compile. Run through glm5_hal.ops (the best backend here)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal

from conftest import assert_invalid, seeded

FP8, I8, I32 = torch.float8_e4m3fn, torch.int8, torch.int32
OUTS = (torch.bfloat16, torch.float16, torch.float32)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def fp8_pair(x: torch.Tensor, block_rows: int = 1):
    """x [R, K] quantized per block_rows x 128 block: (codes, scales [ceil(R/block_rows), K/128])."""
    r, k = x.shape
    pad = -r % block_rows
    xp = torch.cat((x, x.new_zeros(pad, k))) if pad else x
    blocks = xp.float().reshape(xp.shape[0] // block_rows, block_rows, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4) / 448
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(FP8).reshape(xp.shape[0], k)[:r]
    return q, scale


def dequant(q: torch.Tensor, scale: torch.Tensor, block_rows: int) -> torch.Tensor:
    s = scale.double().repeat_interleave(block_rows, 0)[: q.shape[0]].repeat_interleave(128, 1)
    return q.double() * s


def magnitude_bound(a: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """|error| allowed for a float32-accumulated product of float64 operands a [M, K], w [N, K]
    rounded to out_dtype: 1e-5 of the sum of |products| plus one rounding of the output."""
    ulp = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[out_dtype]
    return 1e-5 * (a.abs() @ w.abs().T) + ulp * (a @ w.T).abs() + 1e-30


# -- fp8_block_gemm ------------------------------------------------------------------------------

def test_fp8_block_gemm_on_a_hand_built_example():
    # one activation row, two K blocks; weight rows 0..128 are block row 0, row 129 block row 1
    a = torch.ones(1, 256).to(FP8)
    a_scale = torch.tensor([[2.0, 0.5]])
    w = torch.zeros(130, 256)
    w[0, 0], w[0, 128], w[129, 255] = 3.0, 5.0, 1.0
    w_scale = torch.tensor([[1.0, 4.0], [8.0, 16.0]])
    out = hal.ops.fp8_block_gemm(a, a_scale, w.to(FP8), w_scale, torch.float32)
    assert out.shape == (1, 130) and out.dtype == torch.float32
    # 3 * (2 * 1) + 5 * (0.5 * 4); the last row is in weight block row 1: 1 * (0.5 * 16)
    assert out[0, 0].item() == 3 * 2 + 5 * 0.5 * 4
    assert out[0, 129].item() == 0.5 * 16
    assert not out[0, 1:129].any()


def test_weight_scale_multiplies():
    """`weight_scale_inv` multiplies despite its name (DeepSeek-V3's checkpoints)."""
    a = torch.full((2, 128), 2.0).to(FP8)
    w = torch.full((3, 128), 0.5).to(FP8)
    out = hal.ops.fp8_block_gemm(a, torch.ones(2, 1), w, torch.full((1, 1), 4.0), torch.float32)
    assert torch.equal(out, torch.full((2, 3), 128 * 2 * 0.5 * 4.0))


@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 1, 128), (5, 129, 256), (33, 300, 384), (0, 7, 128), (4, 0, 128), (3, 2, 0)])
def test_fp8_block_gemm_is_the_dequantized_product(out_dtype, m, n, k):
    g = seeded(1)
    a, a_scale = fp8_pair(torch.randn(m, k, generator=g))
    w, w_scale = fp8_pair(torch.randn(n, k, generator=g) / max(k, 1) ** 0.5, 128)
    out = hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    ad, wd = dequant(a, a_scale, 1), dequant(w, w_scale, 128)
    err = (out.double() - ad @ wd.T).abs()
    assert bool((err <= magnitude_bound(ad, wd, out_dtype)).all())


def test_fp8_gemm_of_quantized_operands_is_close_to_the_float_product():
    g = seeded(2)
    x, wf = torch.randn(8, 512, generator=g), torch.randn(64, 512, generator=g) / 512 ** 0.5
    a, a_scale = hal.ops.fp8_block_quant(x, 128)
    w, w_scale = fp8_pair(wf, 128)
    out = hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, torch.float32)
    # two e4m3 roundings (2^-4 relative each) per product, in sums of 512 terms of random sign
    torch.testing.assert_close(out, x @ wf.T, rtol=0.1, atol=0.1)


def test_fp8_nan_codes_poison_their_row_and_column_only():
    a = torch.ones(3, 128).to(FP8)
    w = torch.ones(4, 128).to(FP8)
    a.view(torch.uint8)[1, 5] = 0x7F
    w.view(torch.uint8)[2, 100] = 0xFF
    out = hal.ops.fp8_block_gemm(a, torch.ones(3, 1), w, torch.ones(1, 1), torch.float32)
    nan = torch.zeros(3, 4, dtype=torch.bool)
    nan[1, :], nan[:, 2] = True, True
    assert torch.equal(out.isnan(), nan) and bool((out[~nan] == 128).all())


# -- partial blocks against an independent float64 formula -----------------------------------------
# The scale of element (i, j) is scale[i // 128, j // 128]: computed here by indexing, not by
# repeating blocks as the reference does, with block scales 2^-8 .. 2^8 apart at random, so that a
# partial row or column block that takes a neighbour's scale is off by orders of magnitude (with
# near-identical scales, a misaligned partial block survived every unit test).

def scale_of_every_element(scale: torch.Tensor, rows: int, cols: int, block_rows: int = 128) -> torch.Tensor:
    return scale.double()[torch.arange(rows) // block_rows][:, torch.arange(cols) // 128]


def spread_block_scales(g: torch.Generator, shape) -> torch.Tensor:
    return torch.exp2(torch.randint(-8, 9, shape, generator=g).float()) * (1 + torch.rand(shape, generator=g))


def fp8_codes(g: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 64).clamp(-448, 448).to(FP8)


def fp8_gemm_backends() -> list[str]:
    return [b.name for b in hal.backends() if b.available and "fp8_block_gemm" in b.ops]


@pytest.mark.parametrize("n,k", [(200, 200), (129, 257), (1, 130), (300, 64), (130, 384), (256, 256), (127, 1)])
def test_fp8_block_dequantize_partial_row_and_column_blocks(n, k):
    """The reference's weight dequantization (the models' FP8 -> float and FP8 -> INT8 paths
    and every reference FP8 GEMM): e4m3 codes times a float32 scale are exact in float64, and
    in float32 one rounding of that exact product."""
    g = seeded(n * 1000 + k)
    w, scale = fp8_codes(g, n, k), spread_block_scales(g, (-(-n // 128), -(-k // 128)))
    exact = w.double() * scale_of_every_element(scale, n, k)
    assert torch.equal(hal.reference.quant.fp8_block_dequantize(w, scale, torch.float64), exact)
    assert torch.equal(hal.reference.quant.fp8_block_dequantize(w, scale), exact.float())


@pytest.mark.parametrize("backend", fp8_gemm_backends())
@pytest.mark.parametrize("m,n,k", [(5, 200, 256), (3, 129, 384), (7, 300, 128), (2, 1, 256), (4, 257, 640)])
def test_fp8_block_gemm_partial_row_blocks_against_float64(backend, m, n, k):
    """Every available backend (the reference included, explicitly) on weights with a partial
    last row block, activations with one scale per row and 128 columns."""
    g = seeded(m * 10000 + n * 10 + k)
    a, a_scale = fp8_codes(g, m, k), spread_block_scales(g, (m, k // 128))
    w, w_scale = fp8_codes(g, n, k), spread_block_scales(g, (-(-n // 128), k // 128))
    ad = a.double() * scale_of_every_element(a_scale, m, k, block_rows=1)
    wd = w.double() * scale_of_every_element(w_scale, n, k)
    with hal.use(backend):
        out = hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, torch.float32)
        grouped = hal.ops.fp8_grouped_gemm(torch.cat((a, a)), torch.cat((a_scale, a_scale)), torch.stack((w, w)),
                                           torch.stack((w_scale, w_scale * 4)), torch.tensor([m, m], dtype=I32),
                                           torch.float32)
    bound = magnitude_bound(ad, wd, torch.float32)
    assert bool(((out.double() - ad @ wd.T).abs() <= bound).all())
    assert bool(((grouped[:m].double() - ad @ wd.T).abs() <= bound).all())
    assert bool(((grouped[m:].double() - 4 * (ad @ wd.T)).abs() <= 4 * bound).all())


# -- grouped forms -------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 9), min_size=0, max_size=6), n=st.integers(1, 70),
       kb=st.integers(1, 3), out_dtype=st.sampled_from(OUTS), seed=st.integers(0, 2**16))
def test_property_fp8_grouped_is_the_dense_gemm_per_expert(counts, n, kb, out_dtype, seed):
    g = seeded(seed)
    e, m, k = len(counts), sum(counts), 128 * kb
    a, a_scale = fp8_pair(torch.randn(m, k, generator=g))
    w, w_scale = fp8_pair(torch.randn(e * n, k, generator=g), 128) if e else (torch.empty(0, k, dtype=FP8),
                                                                                torch.empty(0, kb))
    w = w.reshape(e, n, k)
    w_scale = torch.stack([fp8_pair(w[i].float(), 128)[1] for i in range(e)]) if e else torch.empty(0, 1, kb)
    tpe = torch.tensor(counts, dtype=I32)
    out = hal.ops.fp8_grouped_gemm(a, a_scale, w, w_scale, tpe, out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    start = 0
    for i, c in enumerate(counts):
        dense = hal.ops.fp8_block_gemm(a[start:start + c], a_scale[start:start + c], w[i], w_scale[i], out_dtype)
        torch.testing.assert_close(out[start:start + c], dense, rtol=0, atol=0)  # the same kernel per expert
        start += c


@settings(max_examples=25, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 9), min_size=0, max_size=6), n=st.integers(1, 50), k=st.integers(0, 150),
       out_dtype=st.sampled_from(OUTS), seed=st.integers(0, 2**16))
def test_property_int8_grouped_is_the_dense_gemm_per_expert(counts, n, k, out_dtype, seed):
    g = seeded(seed)
    e, m = len(counts), sum(counts)
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=I8)
    w = torch.randint(-128, 128, (e, n, k), generator=g, dtype=I8)
    xs, ws = torch.rand(m, generator=g) / 64, torch.rand(e, n, generator=g) / 64
    out = hal.ops.int8_grouped_gemm(x, xs, w, ws, torch.tensor(counts, dtype=I32), out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    start = 0
    for i, c in enumerate(counts):
        dense = hal.ops.int8_gemm(x[start:start + c], xs[start:start + c], w[i], ws[i], out_dtype, None)
        assert torch.equal(out[start:start + c], dense)
        start += c


# -- int8_quant ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(3, 256), (2, 3, 17), (1, 1), (64,), (0, 8)])
def test_int8_quant_scales_codes_and_round_trip(dtype, shape):
    x = (torch.randn(shape, generator=seeded(3)) * 5).to(dtype)
    q, s = hal.ops.int8_quant(x)
    assert q.dtype == I8 and q.shape == x.shape and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    xf = x.float()
    assert torch.equal(s, xf.abs().amax(-1) / 127) if x.numel() else s.numel() == 0
    assert bool((q != -128).all())
    # |q * s - x| <= s / 2 (round to nearest), the row's largest element maps to +-127
    assert bool(((q.float() * s.unsqueeze(-1) - xf).abs() <= s.unsqueeze(-1) / 2 * (1 + 1e-6)).all())
    if x.numel():
        assert bool((q.abs().amax(-1) == 127).all())


def test_int8_quant_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -3.5, 64.5]])
    q, s = hal.ops.int8_quant(x)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, -2, 0, 126, -4, 64]]


def test_int8_quant_zero_rows_tiny_rows_and_non_finite_rows():
    x = torch.zeros(4, 16)
    x[1, 3] = 1e-41                  # amax / 127 underflows to a subnormal; codes still exact
    x[2, 0] = float("nan")
    x[3, 5] = float("inf")
    q, s = hal.ops.int8_quant(x)
    assert s[0].item() == 0 and not q[0].any()
    assert s[1].item() == torch.tensor(1e-41) / 127 and q[1, 3].item() == 127
    assert s[2].isnan() and not s[3].isfinite()


def test_int8_quant_feeds_int8_gemm():
    g = seeded(4)
    x, wf = torch.randn(6, 300, generator=g), torch.randn(40, 300, generator=g) / 300 ** 0.5
    xq, xs = hal.ops.int8_quant(x)
    wq, ws = hal.ops.int8_quant(wf)   # per output channel: the rows of w
    out = hal.ops.int8_gemm(xq, xs, wq, ws, torch.float32, None)
    torch.testing.assert_close(out, x @ wf.T, rtol=0.05, atol=0.05)


# -- int8_gemm -----------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 17, 5), (17, 129, 67), (70, 40, 300), (0, 3, 8), (3, 0, 8),
                                   (2, 3, 0)])
def test_int8_gemm_integer_sums_are_exact(m, n, k):
    g = seeded(5)
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=I8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=I8)
    out = hal.ops.int8_gemm(x, torch.ones(m), w, torch.ones(n), torch.float32, None)
    assert torch.equal(out, (x.long() @ w.long().T).float())


def test_int8_gemm_cancelling_and_largest_sums():
    k = 131071   # the contract's largest K: 131071 * 128^2 < 2^31
    x = torch.full((1, k), -128, dtype=I8)
    w = torch.full((2, k), -128, dtype=I8)
    w[1, k // 2:] = 127
    out = hal.ops.int8_gemm(x, torch.ones(1), w, torch.ones(2), torch.float32, None)
    exact = (x.long() @ w.long().T).double()
    assert exact[0, 0].item() == 2147467264 and torch.equal(out.double(), exact.float().double())
    # partial sums up to 2^29 that cancel to exactly 1: a float32 accumulator would lose it
    x, w = torch.full((1, 65537), 127, dtype=I8), torch.full((1, 65537), 127, dtype=I8)
    w[0, 32768:] = -127
    x[0, -1], w[0, -1] = 1, 1
    assert hal.ops.int8_gemm(x, torch.ones(1), w, torch.ones(1), torch.float32, None).item() == 1.0


@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
def test_int8_gemm_scales_and_bias(out_dtype):
    g = seeded(6)
    x = torch.randint(-127, 128, (5, 96), generator=g, dtype=I8)
    w = torch.randint(-127, 128, (7, 96), generator=g, dtype=I8)
    xs, ws, bias = torch.rand(5, generator=g), torch.rand(7, generator=g), torch.randn(7, generator=g)
    out = hal.ops.int8_gemm(x, xs, w, ws, out_dtype, bias)
    acc = (x.long() @ w.long().T).float()
    expected = (acc * xs[:, None] * ws[None, :] + bias).to(out_dtype)
    tol = {torch.float32: 4e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=1e-6)


# -- input contract ------------------------------------------------------------------------------

def fp8_args(m=3, n=129, k=256):
    g = seeded(7)
    a, a_scale = fp8_pair(torch.randn(m, k, generator=g))
    w, w_scale = fp8_pair(torch.randn(n, k, generator=g), 128)
    return a, a_scale, w, w_scale


def int8_args(m=3, n=5, k=40):
    g = seeded(8)
    return (torch.randint(-127, 128, (m, k), generator=g, dtype=I8), torch.rand(m, generator=g),
            torch.randint(-127, 128, (n, k), generator=g, dtype=I8), torch.rand(n, generator=g))


def grouped(args, counts):
    a, a_scale, w, w_scale = args
    e = len(counts)
    return (a, a_scale, w.expand(e, *w.shape).contiguous(), w_scale.expand(e, *w_scale.shape).contiguous(),
            torch.tensor(counts, dtype=I32))


def replaced(args, i, value):
    args = list(args)
    args[i] = value(args[i]) if callable(value) else value
    return tuple(args)


BF16 = torch.bfloat16
BAD = [
    ("fp8_block_gemm", lambda: (*fp8_args(k=256)[:2], torch.zeros(5, 200, dtype=FP8), torch.ones(1, 2), BF16), "w",
     "shape [*, 256]"),
    ("fp8_block_gemm", lambda: (torch.zeros(3, 200, dtype=FP8), torch.ones(3, 1), torch.zeros(5, 200, dtype=FP8),
                                torch.ones(1, 1), BF16), "a", "a last dim K that is a multiple of 128"),
    ("fp8_block_gemm", lambda: (*replaced(fp8_args(), 1, lambda s: s[:, :1]), BF16), "a_scale", "shape [3, 2]"),
    ("fp8_block_gemm", lambda: (*replaced(fp8_args(), 3, lambda s: s[:1]), BF16), "w_scale", "shape [2, 2]"),
    ("fp8_block_gemm", lambda: (*replaced(fp8_args(), 0, lambda a: a.bfloat16()), BF16), "a", "dtype float8_e4m3fn"),
    ("fp8_block_gemm", lambda: (*replaced(fp8_args(), 2, lambda w: w.view(torch.uint8)), BF16), "w",
     "dtype float8_e4m3fn"),
    ("fp8_block_gemm", lambda: (*replaced(fp8_args(), 1, lambda s: s.double()), BF16), "a_scale", "dtype float32"),
    ("fp8_block_gemm", lambda: (*fp8_args(), torch.int8), "out_dtype", "one of ['bfloat16', 'float16', 'float32']"),
    ("fp8_block_gemm", lambda: (*replaced(fp8_args(), 2, lambda w: w.to("meta")), BF16), "w", "a tensor on cpu"),
    ("fp8_grouped_gemm", lambda: (*grouped(fp8_args(), (1, 1)), BF16), "tokens_per_expert", "counts summing to 3"),
    ("fp8_grouped_gemm", lambda: (*grouped(fp8_args(), (4, -1)), BF16), "tokens_per_expert", "counts >= 0"),
    ("fp8_grouped_gemm", lambda: (*replaced(grouped(fp8_args(), (1, 2)), 3, lambda s: s[0]), BF16), "w_scale",
     "a 3-d tensor"),
    ("fp8_grouped_gemm", lambda: (*replaced(grouped(fp8_args(), (1, 2)), 4, lambda c: c.long()), BF16),
     "tokens_per_expert", "dtype int32"),
    ("int8_quant", lambda: (torch.zeros(3, 0),), "x", "a last dim K >= 1"),
    ("int8_quant", lambda: (torch.zeros(3, 4, dtype=I8),), "x", "dtype float32 or float16 or bfloat16"),
    ("int8_quant", lambda: (torch.tensor(1.0),), "x", "at least 1 dims"),
    ("int8_gemm", lambda: (*replaced(int8_args(), 1, lambda s: s[:, None]), BF16, None), "x_scale", "a 1-d tensor"),
    ("int8_gemm", lambda: (*replaced(int8_args(), 3, lambda s: s[:4]), BF16, None), "w_scale", "shape [5]"),
    ("int8_gemm", lambda: (*replaced(int8_args(), 2, lambda w: w.int()), BF16, None), "w", "dtype int8"),
    ("int8_gemm", lambda: (*replaced(int8_args(), 0, lambda x: x.float()), BF16, None), "x", "dtype int8"),
    ("int8_gemm", lambda: (*int8_args(), BF16, torch.zeros(4)), "bias", "shape [5]"),
    ("int8_gemm", lambda: (*int8_args(), BF16, torch.zeros(5, dtype=BF16)), "bias", "dtype float32"),
    ("int8_gemm", lambda: (*int8_args(), "bfloat16", None), "out_dtype", "one of"),
    ("int8_gemm", lambda: (torch.zeros(1, 131072, dtype=I8), torch.ones(1), torch.zeros(1, 131072, dtype=I8),
                           torch.ones(1), BF16, None), "x", "a last dim K <= 131071"),
    ("int8_grouped_gemm", lambda: (*grouped(int8_args(), (2, 0, 0)), BF16), "tokens_per_expert",
     "counts summing to 3"),
    ("int8_grouped_gemm", lambda: (*replaced(grouped(int8_args(), (2, 1)), 3, lambda s: s[:, :, None]), BF16),
     "w_scale", "a 2-d tensor"),
    ("int8_grouped_gemm", lambda: (int8_args()[0], int8_args()[1], torch.zeros(0, 5, 40, dtype=I8),
                                   torch.zeros(0, 5), torch.zeros(0, dtype=I32), BF16), "tokens_per_expert",
     "no experts"),
]


@pytest.mark.parametrize("op,make,arg,expected", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_invalid_input_error(op, make, arg, expected):
    assert_invalid(getattr(hal.ops, op), make(), op, arg, expected)


def test_public_defaults_are_bfloat16_without_bias():
    a, a_scale, w, w_scale = fp8_args()
    assert hal.ops.fp8_block_gemm(a, a_scale, w, w_scale).dtype == torch.bfloat16
    x, xs, wi, ws = int8_args()
    assert torch.equal(hal.ops.int8_gemm(x, xs, wi, ws), hal.ops.int8_gemm(x, xs, wi, ws, torch.bfloat16, None))


def test_non_contiguous_inputs_give_the_contiguous_result():
    a, a_scale, w, w_scale = fp8_args(5, 40, 256)
    wt = w.t().contiguous().t()
    a_wide = torch.cat((a, a), 1)[:, :256]
    st = a_scale.t().contiguous().t()
    want = hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, torch.float32)
    assert torch.equal(hal.ops.fp8_block_gemm(a_wide, st, wt, w_scale, torch.float32), want)
    x, xs, wi, ws = int8_args(4, 9, 70)
    want = hal.ops.int8_gemm(x, xs, wi, ws, torch.float32, None)
    assert torch.equal(hal.ops.int8_gemm(torch.cat((x, x), 1)[:, :70], xs, wi.t().contiguous().t(), ws,
                                         torch.float32, None), want)
    xq = torch.randn(64, 6, generator=seeded(9)).t()
    for got, expected in zip(hal.ops.int8_quant(xq), hal.ops.int8_quant(xq.contiguous())):
        assert torch.equal(got, expected)


# -- opcheck, torch.compile, references ----------------------------------------------------------

def opcheck_cases():
    a, a_scale, w, w_scale = fp8_args(4, 33, 256)
    x, xs, wi, ws = int8_args(4, 9, 70)
    return {
        "fp8_block_gemm": (a, a_scale, w, w_scale, torch.float32),
        "fp8_grouped_gemm": (*grouped((a, a_scale, w, w_scale), (1, 0, 3)), torch.bfloat16),
        "int8_quant": (torch.randn(3, 50, generator=seeded(10)).bfloat16(),),
        "int8_gemm": (x, xs, wi, ws, torch.float16, torch.randn(9, generator=seeded(11))),
        "int8_grouped_gemm": (*grouped((x, xs, wi, ws), (2, 2)), torch.float32),
    }


@pytest.mark.parametrize("case", list(opcheck_cases()))
def test_opcheck(case):
    torch_op, args = getattr(torch.ops.glm5_hal, case).default, opcheck_cases()[case]
    if not any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args):
        torch.library.opcheck(torch_op, args)
        return
    # torch's SchemaCheckMode cannot compare float8 tensors on the CPU ("mul_cpu_reduced_float"
    # not implemented), so test_schema is replaced by a byte-level no-mutation check
    before = [a.view(torch.uint8).clone() if a.dtype == FP8 else a.clone()
              for a in args if isinstance(a, torch.Tensor)]
    out = torch_op(*args)
    for a, b in zip([a for a in args if isinstance(a, torch.Tensor)], before):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b)
        assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    torch.library.opcheck(torch_op, args, test_utils=(
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("case", list(opcheck_cases()))
def test_compile_fullgraph(case):
    torch._dynamo.reset()
    args = opcheck_cases()[case]
    op = getattr(hal.ops, case)
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    got, expected = compiled(*args), op(*args)
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)


def test_references_create_nothing_off_the_input_device():
    meta = torch.device("meta")
    a, w = torch.empty(4, 256, device=meta, dtype=FP8), torch.empty(3, 130, 256, device=meta, dtype=FP8)
    s, ws = torch.empty(4, 2, device=meta), torch.empty(3, 2, 2, device=meta)
    assert hal.reference.fp8_block_gemm(a, s, w[0], ws[0]).device == meta
    tpe = torch.tensor([1, 0, 3])   # counts are host data (the reference splits by them)
    out = hal.reference.fp8_grouped_gemm(a, s, w, ws, tpe)
    assert (out.device, out.shape) == (meta, (4, 130))
    q, scale = hal.reference.int8_quant(torch.empty(4, 32, device=meta))
    assert (q.device, q.dtype, scale.shape) == (meta, I8, (4,))
    x, wi = torch.empty(4, 32, device=meta, dtype=I8), torch.empty(2, 5, 32, device=meta, dtype=I8)
    xs, wis = torch.empty(4, device=meta), torch.empty(2, 5, device=meta)
    assert hal.reference.int8_gemm(x, xs, wi[0], wis[0], torch.float32, torch.empty(5, device=meta)).device == meta
    assert hal.reference.int8_grouped_gemm(x, xs, wi, wis, torch.tensor([4, 0])).shape == (4, 5)
