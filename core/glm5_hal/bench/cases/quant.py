"""Benchmark cases of the quantization ops: the FP8 activation quantizer and the INT4 weight
format at the shape of GLM-5's fused expert up-projection; the GEMMs on the checkpoint
formats at prefill and decode shapes, each with torch's own path to the same result."""
from __future__ import annotations

import math

import torch

from ...presets import GLM5
from ..roofline import last_level_cache_bytes
from ..runner import BenchCase
from . import BF16, F32, I32, Shapes, bench_case, randn, seeded


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


# -- GEMMs on the checkpoint formats (docs/ops/quant.md) ---------------------------------------
# Prefill: a 4096-token chunk through q_a_proj [2048, 6144] (the dense GEMMs) and through the
# w13 of the 16 experts of one expert-parallel rank (4096 tokens x top-8 / 16 ranks = 2048
# rows). Decode: 8 tokens through o_proj [6144, 16384], and 2 rows per expert of the rank,
# with enough copies of the weights cycled through that they come from memory, not the cache.
PREFILL_TOKENS = 4096
DECODE_TOKENS = 8


def _gemm_shapes(s: Shapes) -> dict:
    """(M, N, K) of the dense prefill and decode GEMMs, (N, K) of an expert's w13 (K a multiple
    of the FP8 block in every preset)."""
    if s.name == "tiny":
        return dict(prefill=(64, 96, 256), decode=(DECODE_TOKENS, 64, 256), expert=(64, 256))
    return dict(prefill=(PREFILL_TOKENS, GLM5.q_lora_rank, s.hidden),
                decode=(DECODE_TOKENS, s.hidden, GLM5.num_heads * GLM5.v_head_dim),
                expert=(2 * s.moe_intermediate, s.hidden))


def _copies(s: Shapes, weight_bytes: float) -> int:
    """Weight copies whose total is twice the last-level cache (at most 8; 1 for tiny)."""
    if s.name == "tiny":
        return 1
    return max(1, min(8, math.ceil(2 * last_level_cache_bytes() / weight_bytes)))


def _fp8_torch_path(a, a_scale, w, w_scale, out_dtype=torch.bfloat16):
    """torch: dequantize both operands to bfloat16, then one bfloat16 matmul."""
    from ... import reference
    ad = reference.quant._scaled_blocks(a.float(), a_scale).bfloat16()
    return (ad @ reference.quant.fp8_block_dequantize(w, w_scale).bfloat16().T).to(out_dtype)


def _fp8_grouped_torch_path(a, a_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16):
    out = torch.empty((a.shape[0], w.shape[1]), dtype=out_dtype)
    start = 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        if n:
            out[start:start + n] = _fp8_torch_path(a[start:start + n], a_scale[start:start + n], w[e], w_scale[e],
                                                   out_dtype)
            start += n
    return out


def _int8_torch_path(x, x_scale, w, w_scale, out_dtype=torch.bfloat16, bias=None):
    """torch: torch._int_mm (int8 x int8 -> int32), then the float32 scaling."""
    out = torch._int_mm(x, w.t()).float() * x_scale[:, None] * w_scale[None, :]
    return (out if bias is None else out + bias).to(out_dtype)


def _routed_counts(g, rows: int, experts: int) -> torch.Tensor:
    return torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts).to(I32)


def _fp8_weights(g, experts: int, n: int, k: int):
    from ...conformance.cases.quant import fp8_weights
    return fp8_weights(g, experts, n, k)


def _int8_weights(g, experts: int, n: int, k: int):
    from ...conformance.cases.quant import int8_weights
    return int8_weights(g, experts, n, k)


def _gemm_bytes(m: int, n: int, k: int, experts: int = 1, element: float = 1.0) -> float:
    """Weights and activations read once (1 byte per FP8 / INT8 element), bf16 output written."""
    return element * (experts * n * k + m * k) + 2 * m * n


def _dense_cases(s: Shapes, make_operands, label: str, compute: str, baseline) -> list[BenchCase]:
    """The prefill and decode cases of a dense GEMM; make_operands(g, m, n, k) -> its args."""
    cases = []
    for phase, (m, n, k) in ((p, _gemm_shapes(s)[p]) for p in ("prefill", "decode")):
        cases.append(BenchCase(f"{phase} [{m}, {k}] x [{n}, {k}] {label}",
                               lambda m=m, n=n, k=k, phase=phase: make_operands(seeded(f"{label}-{phase}"), m, n, k),
                               flops=2 * m * n * k, nbytes=_gemm_bytes(m, n, k), compute=compute,
                               baselines=(baseline,), rotate=_copies(s, n * k) if phase == "decode" else 1))
    return cases


@bench_case("fp8_block_gemm")
def fp8_block_gemm(s: Shapes) -> list[BenchCase]:
    def make(g, m, n, k):
        a, a_scale = fp8_block_quant_of(randn(g, (m, k)))
        w, w_scale = _fp8_weights(g, 1, n, k)
        return a, a_scale, w[0], w_scale[0], BF16
    return _dense_cases(s, make, "fp8", "bf16", ("torch: dequant + bf16 mm", _fp8_torch_path))


def fp8_block_quant_of(x: torch.Tensor):
    from ... import reference
    return reference.fp8_block_quant(x, 128)


def _grouped_cases(s: Shapes, make_operands, label: str, compute: str, baselines=()) -> list[BenchCase]:
    """The prefill and decode cases of a grouped GEMM over the rank's experts' w13;
    make_operands(g, rows, experts, n, k) -> its args."""
    (n, k), experts = _gemm_shapes(s)["expert"], s.local_experts
    cases = []
    for phase, rows in (("prefill", _prefill_rows(s)), ("decode", 2 * experts)):
        cases.append(BenchCase(f"{phase} {experts} experts, [{rows}, {k}] x [{n}, {k}] {label}",
                               lambda rows=rows, phase=phase: make_operands(seeded(f"{label}g-{phase}"), rows,
                                                                            experts, n, k),
                               flops=2 * rows * n * k, nbytes=_gemm_bytes(rows, n, k, experts), compute=compute,
                               compile_reference=False, baselines=baselines,
                               rotate=_copies(s, experts * n * k) if phase == "decode" else 1))
    return cases


@bench_case("fp8_grouped_gemm")
def fp8_grouped_gemm(s: Shapes) -> list[BenchCase]:
    def make(g, rows, experts, n, k):
        counts = _routed_counts(g, rows, experts)
        a, a_scale = fp8_block_quant_of(randn(g, (rows, k)))
        w, w_scale = _fp8_weights(g, experts, n, k)
        return a, a_scale, w, w_scale, counts, BF16
    return _grouped_cases(s, make, "fp8", "bf16", (("torch: dequant + bf16 mm", _fp8_grouped_torch_path),))


def _prefill_rows(s: Shapes) -> int:
    """The rows one rank's experts get from a prefill chunk: tokens x top-k / ranks."""
    tokens = 64 if s.name == "tiny" else PREFILL_TOKENS
    return tokens * s.top_k * s.local_experts // s.experts


@bench_case("int8_quant")
def int8_quant(s: Shapes) -> BenchCase:
    T, H = s.tokens, s.hidden
    return BenchCase(f"[{T}, {H}] bf16", lambda: (randn(seeded("int8q"), (T, H)),), nbytes=3 * T * H + 4 * T)


@bench_case("int8_gemm")
def int8_gemm(s: Shapes) -> list[BenchCase]:
    def make(g, m, n, k):
        from ... import reference
        x, x_scale = reference.int8_quant(randn(g, (m, k), F32))
        w, w_scale = _int8_weights(g, 1, n, k)
        return x, x_scale, w[0], w_scale[0], BF16, None
    return _dense_cases(s, make, "int8", "int8", ("torch: _int_mm + scaling", _int8_torch_path))


@bench_case("int8_grouped_gemm")
def int8_grouped_gemm(s: Shapes) -> list[BenchCase]:
    def make(g, rows, experts, n, k):
        from ... import reference
        counts = _routed_counts(g, rows, experts)
        x, x_scale = reference.int8_quant(randn(g, (rows, k), F32))
        w, w_scale = _int8_weights(g, experts, n, k)
        return x, x_scale, w, w_scale, counts, BF16
    return _grouped_cases(s, make, "int8", "int8")
