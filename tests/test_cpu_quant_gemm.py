"""The cpu backend's native GEMMs on the checkpoint formats and its bfloat16 grouped_gemm
(csrc/qgemm.cpp), on every tile tier this CPU has (portable, AVX2, AVX-VNNI, AVX-512, AMX):
against the float64 reference with a bound from the products' magnitudes, exact int32 sums,
int8_quant bit for bit, the native count validation, thread-count independence, and
hypothesis-drawn shapes through the Python wrappers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5_hal as hal
from glm5_hal import InvalidInputError, _C

from cpu_helpers import FLOATS, chosen, cpu_impl, gen, isa_limit, tier  # noqa: F401

FP8, I8, I32 = torch.float8_e4m3fn, torch.int8, torch.int32
OUTS = (torch.bfloat16, torch.float16, torch.float32)
TIER_NAMES = {0: "portable", 1: "avx2", 2: "avx_vnni", 3: "avx512", 4: "amx"}


def _distinct_tiers() -> list[int]:
    """The limits at which the float or the int8 path changes tier (each tested once)."""
    seen, limits = set(), []
    previous = _C.qgemm_set_isa_limit(4)
    try:
        for limit in range(_C.qgemm_max_isa(), -1, -1):
            _C.qgemm_set_isa_limit(limit)
            key = (_C.qgemm_float_isa(), _C.qgemm_int8_isa())
            if key not in seen:
                seen.add(key)
                limits.append(limit)
    finally:
        _C.qgemm_set_isa_limit(previous)
    return limits


GEMM_TIERS = _distinct_tiers()


def gemm_isa_limit(level: int):
    return isa_limit(level, _C.qgemm_set_isa_limit)


@pytest.fixture(params=GEMM_TIERS, ids=lambda t: TIER_NAMES[t])
def gemm_tier(request):
    """Runs the test once per GEMM tile tier this CPU has."""
    with gemm_isa_limit(request.param):
        yield request.param


def fp8_operands(g, m, n, k, experts=None):
    a = (torch.randn(m, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    a_scale = torch.exp2(torch.randint(-8, 0, (m, k // 128), generator=g).float()) * (1 + torch.rand(m, k // 128, generator=g))
    shape = (n, k) if experts is None else (experts, n, k)
    w = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(FP8)
    sshape = (-(-n // 128), k // 128) if experts is None else (experts, -(-n // 128), k // 128)
    w_scale = torch.rand(sshape, generator=g) / (100 * max(k, 1) ** 0.5)
    return a, a_scale, w, w_scale


def dequant(q, scale, block_rows):
    s = scale.double().repeat_interleave(block_rows, -2)[..., : q.shape[-2], :].repeat_interleave(128, -1)
    return q.double() * s


ULP = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
SUBNORMAL = {torch.float32: 2 ** -149, torch.float16: 2 ** -24, torch.bfloat16: 2 ** -133}  # smallest spacing


def assert_within_magnitude(out, a, w, out_dtype):
    """|out - a @ w^T| <= 1e-5 sum |a w| + one rounding of the output (a and w float64)."""
    want = a @ w.T
    bound = 1e-5 * (a.abs() @ w.abs().T) + ULP[out_dtype] * want.abs() + SUBNORMAL[out_dtype]
    err = (out.double() - want).abs()
    assert out.dtype == out_dtype and out.shape == want.shape
    assert bool(((err <= bound) | (want.isnan() & out.isnan())).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 1, 128), (17, 129, 256), (33, 300, 1152), (130, 64, 384)])
def test_fp8_block_gemm(gemm_tier, out_dtype, m, n, k):
    a, a_scale, w, w_scale = fp8_operands(gen("fp8", m, n, k), m, n, k)
    assert chosen("fp8_block_gemm", a, a_scale, w, w_scale, out_dtype) == "cpu.fp8_block_gemm"
    out = hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, out_dtype)
    assert_within_magnitude(out, dequant(a, a_scale, 1), dequant(w, w_scale, 128), out_dtype)


@pytest.mark.parametrize("counts", [(0, 5, 0, 33, 1, 0), (70,), (0, 0), ()])
def test_fp8_grouped_gemm(gemm_tier, counts):
    g = gen("fp8g", counts)
    m, n, k, e = sum(counts), 40, 256, len(counts)
    a, a_scale, w, w_scale = fp8_operands(g, m, n, k, experts=e)
    tpe = torch.tensor(counts, dtype=I32)
    out = hal.ops.fp8_grouped_gemm(a, a_scale, w, w_scale, tpe, torch.float32)
    assert out.shape == (m, n)
    start = 0
    for i, c in enumerate(counts):
        rows = slice(start, start + c)
        assert_within_magnitude(out[rows], dequant(a[rows], a_scale[rows], 1), dequant(w[i], w_scale[i], 128),
                                torch.float32)
        start += c


@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 17, 5), (17, 129, 67), (70, 64, 2100), (2, 3, 0)])
def test_int8_gemm_is_exact_then_scaled(gemm_tier, out_dtype, m, n, k):
    g = gen("int8", m, n, k)
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=I8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=I8)
    xs, ws, bias = torch.rand(m, generator=g), torch.rand(n, generator=g), torch.randn(n, generator=g)
    assert chosen("int8_gemm", x, xs, w, ws, out_dtype, bias) == "cpu.int8_gemm"
    out = hal.ops.int8_gemm(x, xs, w, ws, out_dtype, bias)
    acc = (x.long() @ w.long().T).float()   # exact (|sum| < 2^24 here), then float32 scaling
    assert torch.equal(out, (acc * xs[:, None] * ws[None, :] + bias).to(out_dtype))


def test_int8_gemm_largest_sums(gemm_tier):
    k = 131071
    x = torch.full((3, k), -128, dtype=I8)
    w = torch.full((2, k), -128, dtype=I8)
    w[1, ::3] = 127
    out = hal.ops.int8_gemm(x, torch.ones(3), w, torch.ones(2), torch.float32, None)
    assert torch.equal(out, (x.long() @ w.long().T).float())


@pytest.mark.parametrize("counts", [(0, 5, 0, 36, 1, 0), (3,), ()])
def test_int8_grouped_gemm_is_exact(gemm_tier, counts):
    g = gen("int8g", counts)
    m, n, k, e = sum(counts), 33, 100, len(counts)
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=I8)
    w = torch.randint(-128, 128, (e, n, k), generator=g, dtype=I8)
    out = hal.ops.int8_grouped_gemm(x, torch.ones(m), w, torch.ones(e, n), torch.tensor(counts, dtype=I32),
                                    torch.float32)
    parts = [x[sum(counts[:i]):sum(counts[:i + 1])].long() @ w[i].long().T for i in range(e)]
    assert torch.equal(out, torch.cat(parts).float() if parts else torch.empty(0, n))


@pytest.mark.parametrize("counts", [(5, 0, 12), (40, 1), (0, 0, 0)])
@pytest.mark.parametrize("k", [1, 33, 1030])
def test_bf16_grouped_gemm_is_native(gemm_tier, counts, k):
    g = gen("bf16g", counts, k)
    m, n, e = sum(counts), 70, len(counts)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).bfloat16()
    tpe = torch.tensor(counts, dtype=I32)
    assert chosen("grouped_gemm", x, w, tpe) == "cpu.grouped_gemm"
    out = hal.ops.grouped_gemm(x, w, tpe)
    start = 0
    for i, c in enumerate(counts):
        assert_within_magnitude(out[start:start + c], x[start:start + c].double(), w[i].double(), torch.bfloat16)
        start += c


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_int8_quant_bit_exact(tier, dtype):
    g = gen("int8q", str(dtype), tier)
    x = (torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    x[3] = 0
    x[4, :4] = torch.tensor([127.0, 0.5, 2.5, -3.5])
    x[4, 4:] = 0
    q, s = hal.ops.int8_quant(x)
    rq, rs = hal.reference.int8_quant(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)


def test_native_count_validation_writes_nothing():
    a, a_scale, w, w_scale = fp8_operands(gen("counts"), 6, 17, 128, experts=3)
    fn = cpu_impl("fp8_grouped_gemm")
    for counts, expected in (((6, -1, 1), "counts >= 0"), ((1, 1, 1), "counts summing to 6"),
                             ((4, 4, 0), "counts summing to 6")):
        with pytest.raises(InvalidInputError, match=expected) as info:
            fn(a, a_scale, w, w_scale, torch.tensor(counts, dtype=I32), torch.bfloat16)
        assert info.value.arg == "tokens_per_expert"
    x, ws = torch.zeros(6, 64, dtype=I8), torch.ones(3, 17)
    with pytest.raises(InvalidInputError, match="counts summing to 6"):
        cpu_impl("int8_grouped_gemm")(x, torch.ones(6), torch.zeros(3, 17, 64, dtype=I8), ws,
                                      torch.tensor([1, 2, 2], dtype=I32), torch.float32)


def test_streamed_and_packed_forms_agree_bit_for_bit(gemm_tier):
    """64 rows stream the weights, 65 pack them (csrc/qgemm.cpp): the first 64 rows agree."""
    a, a_scale, w, w_scale = fp8_operands(gen("forms"), 65, 100, 384)
    fp8 = hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, torch.float32)
    assert torch.equal(hal.ops.fp8_block_gemm(a[:64], a_scale[:64], w, w_scale, torch.float32), fp8[:64])
    x, wb = torch.randn(65, 300, generator=gen("forms-b")).bfloat16(), torch.randn(1, 70, 300).bfloat16()
    bf = hal.ops.grouped_gemm(x, wb, torch.tensor([65], dtype=I32))
    assert torch.equal(hal.ops.grouped_gemm(x[:64], wb, torch.tensor([64], dtype=I32)), bf[:64])


def test_results_do_not_depend_on_the_thread_count():
    a, a_scale, w, w_scale = fp8_operands(gen("threads"), 70, 300, 384)
    x = torch.randint(-128, 128, (70, 300), generator=gen("threads-x"), dtype=I8)
    wi = torch.randint(-128, 128, (600, 300), generator=gen("threads-w"), dtype=I8)
    # bf16 grouped_gemm: work items of (expert, weight-row block), sized by the thread count
    xb = torch.randn(70, 300, generator=gen("threads-xb")).bfloat16()
    wb = torch.randn(3, 500, 300, generator=gen("threads-wb")).bfloat16()
    counts = torch.tensor([30, 0, 40], dtype=I32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append((hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, torch.float32),
                            hal.ops.int8_gemm(x, torch.rand(70, generator=gen("s")), wi, torch.ones(600),
                                              torch.bfloat16, None),
                            hal.ops.grouped_gemm(xb, wb, counts)))
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert all(torch.equal(got, first) for got, first in zip(r, results[0]))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=5), n=st.integers(1, 100), kb=st.integers(1, 3),
       out_dtype=st.sampled_from(OUTS), strided=st.booleans(), limit=st.sampled_from(GEMM_TIERS),
       seed=st.integers(0, 2**16))
def test_property_fp8_grouped_against_the_reference(counts, n, kb, out_dtype, strided, limit, seed):
    g = torch.Generator().manual_seed(seed)
    m, k, e = sum(counts), 128 * kb, len(counts)
    a, a_scale, w, w_scale = fp8_operands(g, m, n, k, experts=e)
    if strided:   # a row slice of wider rows, a weight stored [E, K, N]
        a = torch.cat((a, a), 1)[:, :k]
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    with gemm_isa_limit(limit):
        out = cpu_impl("fp8_grouped_gemm")(a, a_scale, w, w_scale, torch.tensor(counts, dtype=I32), out_dtype)
    start = 0
    for i, c in enumerate(counts):
        rows = slice(start, start + c)
        assert_within_magnitude(out[rows], dequant(a[rows], a_scale[rows], 1), dequant(w[i], w_scale[i], 128),
                                out_dtype)
        start += c


@settings(max_examples=30, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=5), n=st.integers(1, 100), k=st.integers(0, 300),
       bias=st.booleans(), out_dtype=st.sampled_from(OUTS), limit=st.sampled_from(GEMM_TIERS),
       seed=st.integers(0, 2**16))
def test_property_int8_against_exact_sums(counts, n, k, bias, out_dtype, limit, seed):
    g = torch.Generator().manual_seed(seed)
    m, e = sum(counts), len(counts)
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=I8)
    w = torch.randint(-128, 128, (e, n, k), generator=g, dtype=I8)
    xs, ws = torch.rand(m, generator=g) / 256, torch.rand(e, n, generator=g) / 256   # float16-safe outputs
    b = torch.randn(n, generator=g) if bias and e == 1 else None
    with gemm_isa_limit(limit):
        if e == 1:
            out = cpu_impl("int8_gemm")(x, xs, w[0], ws[0], out_dtype, b)
        else:
            out = cpu_impl("int8_grouped_gemm")(x, xs, w, ws, torch.tensor(counts, dtype=I32), out_dtype)
    start = 0
    for i, c in enumerate(counts):
        acc = (x[start:start + c].long() @ w[i].long().T).double()
        scaled = acc * xs[start:start + c, None].double() * ws[i, None, :].double()
        bias_part = b.double() if b is not None else torch.zeros(n, dtype=torch.float64)
        want = scaled + bias_part
        # exact sums; float32 scaling and bias (4 roundings of the terms) and the output's rounding
        bound = 4 * 2 ** -24 * (scaled.abs() + bias_part.abs()) + ULP[out_dtype] * want.abs() + SUBNORMAL[out_dtype]
        assert bool(((out[start:start + c].double() - want).abs() <= bound).all())
        start += c
