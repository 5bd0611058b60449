"""Benchmark cases of the quantization ops: the FP8 activation quantizer and the INT4 weight
format at the shape of GLM-5's fused expert up-projection."""
from __future__ import annotations

from ..runner import BenchCase
from . import Shapes, bench_case, randn, seeded


def _weight(s: Shapes) -> tuple[int, int, int]:
    """(N, K, group size) of the INT4 weight: the fused w13 of one expert."""
    return 2 * s.moe_intermediate, s.hidden, s.group_size


def _packed(s: Shapes):
    from ... import reference
    n, k, g = _weight(s)
    return reference.int4_pack(randn(seeded("i4"), (n, k)), g)


@bench_case("fp8_block_quant")
def fp8_block_quant(s: Shapes) -> BenchCase:
    T, H = s.tokens, s.hidden
    return BenchCase(f"[{T}, {H}] bf16 block 128 ue8m0",
                     lambda: (randn(seeded("fp8"), (T, H)), 128 if H % 128 == 0 else H, "ue8m0"),
                     nbytes=3 * T * H + T * H // 32)


@bench_case("int4_fake_quant")
def int4_fake_quant(s: Shapes) -> BenchCase:
    n, k, g = _weight(s)
    return BenchCase(f"[{n}, {k}] bf16 g{g}", lambda: (randn(seeded("i4"), (n, k)), g), nbytes=4 * n * k)


@bench_case("int4_pack")
def int4_pack(s: Shapes) -> BenchCase:
    n, k, g = _weight(s)
    return BenchCase(f"[{n}, {k}] bf16 g{g}", lambda: (randn(seeded("i4"), (n, k)), g), nbytes=2.5 * n * k)


@bench_case("int4_unpack")
def int4_unpack(s: Shapes) -> BenchCase:
    n, k, g = _weight(s)
    return BenchCase(f"[{n}, {k // 8}] int32 g{g}", lambda: (*_packed(s), g), nbytes=4.5 * n * k)


@bench_case("w4a16_gemm")
def w4a16_gemm(s: Shapes) -> BenchCase:
    n, k, g = _weight(s)
    m = min(s.tokens, 128)
    return BenchCase(f"[{m}, {k}] x [{n}, {k}] int4", lambda: (randn(seeded("w4x"), (m, k)), *_packed(s), g),
                     flops=2 * m * n * k, nbytes=0.5 * n * k + 2 * m * (k + n))
