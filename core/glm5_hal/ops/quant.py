"""Quantization ops (docs/ops/quant.md): FP8 block quantization and the symmetric INT4 weight
format (fake-quant for QAT, packing, unpacking, the W4A16 GEMM); the GEMMs on the checkpoint
formats (section 3.1): FP8 with 128 x 128 block scales, INT8 W8A8, and their grouped forms."""
from __future__ import annotations

import torch

from .. import checks as C
from .. import reference as ref
from ..checks import FLOAT_DTYPES as FLOAT, FP8
from ..contract import Choice, DType, Int, Let, Out, Rule, Tensor
from ..opdef import define, defined_in

SCALE_FORMATS = (None, "ue8m0")
NIBBLES_PER_WORD = 8
F32, I32, I8 = (torch.float32,), (torch.int32,), (torch.int8,)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = ref.quant.FP8_GEMM_BLOCK

_PACKABLE = f"a last dim K divisible by {NIBBLES_PER_WORD} (nibbles per int32 word)"


def _divides(arg: str, what: str) -> Rule:
    return Rule(arg, f"K % {arg} == 0", f"a divisor of K = {{K}} ({what})")


def _fake_fp8_block_quant(x, block, scale_fmt):
    return (torch.empty(x.shape, dtype=FP8, device=x.device),
            x.new_empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.float32))


fp8_block_quant = define(
    ref.fp8_block_quant,
    args=dict(x=Tensor("..., K", FLOAT), block=Int(min=1), scale_fmt=Choice(SCALE_FORMATS)),
    rules=[_divides("block", "the last dim of 'x'")],
    fake=_fake_fp8_block_quant,
    doc="""Per-block FP8 (e4m3) quantization along the last dim.

    x:         [..., K] bfloat16 | float16 | float32
    block:     int >= 1 dividing K: the number of consecutive elements sharing one scale
    scale_fmt: None (scale = amax / 448) or "ue8m0" (scale rounded up to a power of two)
    returns (q float8_e4m3fn [..., K], scale float32 [..., K / block]) with
    amax = max(max |x_block|, 1e-4), q = clamp(x / scale, -448, 448) rounded to nearest even;
    q.float() * scale dequantizes.
    """)


def _setup_straight_through(ctx, inputs, output):
    pass  # the backward needs nothing: the gradient passes through unchanged


def _straight_through_backward(ctx, grad):
    return grad, None


def _straight_through_jvp(inputs, tangents):
    return tangents[0]


int4_fake_quant = define(
    ref.int4_fake_quant,
    args=dict(w=Tensor("N, K", FLOAT), group_size=Int(min=1)),
    rules=[_divides("group_size", "the last dim of 'w'")],
    fake=lambda w, group_size: torch.empty_like(w),
    autograd=(_straight_through_backward, _setup_straight_through, _straight_through_jvp),
    doc="""Quantize-dequantize to the symmetric INT4 grid (QAT forward); straight-through backward.

    w:          [N, K] bfloat16 | float16 | float32
    group_size: int >= 1 dividing K: consecutive elements of a row sharing one scale
    returns [N, K] like w: per group s = max(amax / 7, 1e-5), q = clamp(round(w / s), -7, 7)
    (round half to even), result q * s computed in float32. The gradient w.r.t. w is the
    upstream gradient, unchanged.
    """)

int4_pack = define(
    ref.int4_pack,
    args=dict(w=Tensor("N, K", FLOAT), group_size=Int(min=1)),
    rules=[Rule("w", f"K % {NIBBLES_PER_WORD} == 0", _PACKABLE),
           _divides("group_size", "the last dim of 'w'")],
    fake=lambda w, group_size: (
        w.new_empty((w.shape[0], w.shape[1] // NIBBLES_PER_WORD), dtype=torch.int32),
        w.new_empty((w.shape[0], w.shape[1] // group_size), dtype=torch.float32)),
    doc="""Quantize to symmetric INT4 and pack 8 nibbles per int32 (compressed-tensors
    "pack-quantized" order).

    w:          [N, K] bfloat16 | float16 | float32, K divisible by 8
    group_size: int >= 1 dividing K
    returns (packed int32 [N, K / 8], scale float32 [N, K / group_size]): s and q as in
    int4_fake_quant; nibble u = q + 8 of element 8j + i of a row sits in bits 4i..4i+3 of
    packed[:, j] (bit 31 set makes the int32 negative).
    """)

int4_unpack = define(
    ref.int4_unpack,
    args=dict(packed=Tensor("N, W", I32), group_size=Int(min=1),
              scale=Tensor("N, K // group_size", F32)),
    rules=[Let("K", f"W * {NIBBLES_PER_WORD}"),
           _divides("group_size", f"{NIBBLES_PER_WORD} * packed.shape[1]")],
    fake=lambda packed, scale, group_size: packed.new_empty(
        (packed.shape[0], packed.shape[1] * NIBBLES_PER_WORD), dtype=torch.float32),
    doc="""The dequantized weight of an int4_pack result (its exact inverse).

    packed:     [N, K / 8] int32
    scale:      [N, K / group_size] float32, same device
    group_size: int >= 1 dividing K = 8 * packed.shape[1]
    returns [N, K] float32: (u - 8) * scale of the element's group, u its nibble.
    """)

w4a16_gemm = define(
    ref.w4a16_gemm,
    args=dict(x=Tensor("M, K", FLOAT), packed=Tensor(f"N, K // {NIBBLES_PER_WORD}", I32),
              group_size=Int(min=1), scale=Tensor("N, K // group_size", F32)),
    rules=[Rule("x", f"K % {NIBBLES_PER_WORD} == 0", _PACKABLE),
           _divides("group_size", f"{NIBBLES_PER_WORD} * packed.shape[1]")],
    fake=lambda x, packed, scale, group_size: x.new_empty((x.shape[0], packed.shape[0])),
    out=Out("M, N", dtype="x"),
    differentiable=True,
    doc="""Activations times a packed INT4 weight, transposed (a linear layer).

    x:          [M, K] bfloat16 | float16 | float32, K divisible by 8
    packed:     [N, K / 8] int32 (int4_pack layout), same device
    scale:      [N, K / group_size] float32, same device
    group_size: int >= 1 dividing K
    returns [M, N] like x: x @ int4_unpack(packed, scale, group_size)^T, float32 accumulation.
    out:        optional [M, N] buffer of x's dtype, written and returned (docs/ops.md, "out= buffers").
    Differentiable w.r.t. x (and scale).
    """)


# -- GEMMs on the checkpoint formats (docs/ops/quant.md) -------------------------------------
_K_BLOCKS = Rule("a", f"K % {BLOCK} == 0", f"a last dim K that is a multiple of {BLOCK} (the FP8 block)")
# |x * w| <= 128^2 for int8 operands: K products fit the contract's exact int32 accumulator
INT8_MAX_K = (2**31 - 1) // 128**2
_INT8_K = Rule("x", f"K <= {INT8_MAX_K}", f"a last dim K <= {INT8_MAX_K} (K products of int8 values, each "
                                          "at most 128^2 in magnitude, must fit the int32 accumulator)")


def _fake_gemm(rows, n, like, out_dtype):
    return like.new_empty((rows, n), dtype=out_dtype)


fp8_block_gemm = define(
    ref.fp8_block_gemm,
    args=dict(a=Tensor("M, K", (FP8,)), a_scale=Tensor(f"M, K // {BLOCK}", F32), w=Tensor("N, K", (FP8,)),
              w_scale=Tensor(f"ceil_div(N, {BLOCK}), K // {BLOCK}", F32), out_dtype=DType(OUT_DTYPES)),
    rules=[_K_BLOCKS],
    fake=lambda a, a_scale, w, w_scale, out_dtype: _fake_gemm(a.shape[0], w.shape[0], a, out_dtype),
    out=Out("M, N", dtype="out_dtype"),
    doc=f"""A GEMM on DeepSeek-V3 / GLM-5 FP8 checkpoint weights (DeepGEMM's fp8_gemm_nt).

    a:         [M, K] float8_e4m3fn activations, K a multiple of {BLOCK}
    a_scale:   [M, K / {BLOCK}] float32: one scale per token and {BLOCK} columns (fp8_block_quant(x, {BLOCK}))
    w:         [N, K] float8_e4m3fn weight (a linear layer's, out x in)
    w_scale:   [ceil(N / {BLOCK}), K / {BLOCK}] float32: one scale per {BLOCK} x {BLOCK} block, which multiplies
               (the checkpoints' `weight_scale_inv`)
    out_dtype: bfloat16 (default) | float16 | float32
    returns [M, N] out_dtype: sum_k (a[m, k] a_scale[m, k/{BLOCK}]) (w[n, k] w_scale[n/{BLOCK}, k/{BLOCK}]),
            accumulated in float32.
    out:       optional [M, N] buffer of out_dtype, written and returned (docs/ops.md, "out= buffers").
    """)

fp8_grouped_gemm = define(
    ref.fp8_grouped_gemm,
    args=dict(a=Tensor("M, K", (FP8,)), a_scale=Tensor(f"M, K // {BLOCK}", F32), w=Tensor("E, N, K", (FP8,)),
              w_scale=Tensor(f"E, ceil_div(N, {BLOCK}), K // {BLOCK}", F32), tokens_per_expert=Tensor("E", I32),
              out_dtype=DType(OUT_DTYPES)),
    rules=[_K_BLOCKS],
    check_values=lambda a, a_scale, w, w_scale, tokens_per_expert, out_dtype: C.expert_counts(
        "fp8_grouped_gemm", tokens_per_expert, a.shape[0], "a"),
    fake=lambda a, a_scale, w, w_scale, tokens_per_expert, out_dtype: _fake_gemm(a.shape[0], w.shape[1], a,
                                                                                  out_dtype),
    out=Out("M, N", dtype="out_dtype"),
    doc=f"""fp8_block_gemm per expert over its contiguous rows (moe_permute's layout).

    a, a_scale:        [M, K], [M, K / {BLOCK}] as fp8_block_gemm; rows contiguous per expert, in expert order
    w:                 [E, N, K] float8_e4m3fn, one weight per expert
    w_scale:           [E, ceil(N / {BLOCK}), K / {BLOCK}] float32
    tokens_per_expert: [E] int32 >= 0 summing to M (experts with zero rows are valid)
    out_dtype:         bfloat16 (default) | float16 | float32
    returns [M, N] out_dtype: the rows of expert e times w[e] as fp8_block_gemm.
    out:       optional [M, N] buffer of out_dtype, written and returned (docs/ops.md, "out= buffers").
    """)


def _fake_int8_quant(x):
    return torch.empty(x.shape, dtype=torch.int8, device=x.device), x.new_empty(x.shape[:-1], dtype=torch.float32)


int8_quant = define(
    ref.int8_quant,
    args=dict(x=Tensor("..., K", FLOAT)),
    rules=[Rule("x", "K >= 1", "a last dim K >= 1 (a row to take the maximum of)")],
    fake=_fake_int8_quant,
    doc="""Dynamic symmetric per-token INT8 quantization (W8A8 activations).

    x:      [..., K] bfloat16 | float16 | float32
    returns (q int8 [..., K], scale float32 [...]): per row s = max |x| / 127 and
            q = clamp(round_half_even(x / s), -127, 127), computed in float32; an all-zero
            row (or one so small that s underflows to 0) gets s = 0 and q = 0. q * s
            dequantizes. A row holding inf or nan gets a non-finite s (its codes are
            unspecified; q * s is nan).
    """)

int8_gemm = define(
    ref.int8_gemm,
    args=dict(x=Tensor("M, K", I8), x_scale=Tensor("M", F32), w=Tensor("N, K", I8), w_scale=Tensor("N", F32),
              out_dtype=DType(OUT_DTYPES), bias=Tensor("N", F32, optional=True)),
    rules=[_INT8_K],
    fake=lambda x, x_scale, w, w_scale, out_dtype, bias: _fake_gemm(x.shape[0], w.shape[0], x, out_dtype),
    out=Out("M, N", dtype="out_dtype"),
    doc="""A W8A8 GEMM: per-token activation scales times per-channel weight scales.

    x:         [M, K] int8 activations (int8_quant), K <= 131071
    x_scale:   [M] float32
    w:         [N, K] int8 weight
    w_scale:   [N] float32, one scale per output channel
    out_dtype: bfloat16 (default) | float16 | float32
    bias:      [N] float32 or None
    returns [M, N] out_dtype: float(sum_k x[m, k] w[n, k]) * x_scale[m] * w_scale[n] (+ bias[n]);
            the integer sum is exact (int32), so backends agree up to float32 rounding of the scaling.
    out:       optional [M, N] buffer of out_dtype, written and returned (docs/ops.md, "out= buffers").
    """)

int8_grouped_gemm = define(
    ref.int8_grouped_gemm,
    args=dict(x=Tensor("M, K", I8), x_scale=Tensor("M", F32), w=Tensor("E, N, K", I8), w_scale=Tensor("E, N", F32),
              tokens_per_expert=Tensor("E", I32), out_dtype=DType(OUT_DTYPES)),
    rules=[_INT8_K],
    check_values=lambda x, x_scale, w, w_scale, tokens_per_expert, out_dtype: C.expert_counts(
        "int8_grouped_gemm", tokens_per_expert, x.shape[0], "x"),
    fake=lambda x, x_scale, w, w_scale, tokens_per_expert, out_dtype: _fake_gemm(x.shape[0], w.shape[1], x,
                                                                                  out_dtype),
    out=Out("M, N", dtype="out_dtype"),
    doc="""int8_gemm per expert over its contiguous rows (moe_permute's layout).

    x, x_scale:        [M, K] int8, [M] float32; rows contiguous per expert, in expert order
    w:                 [E, N, K] int8, one weight per expert
    w_scale:           [E, N] float32
    tokens_per_expert: [E] int32 >= 0 summing to M
    out_dtype:         bfloat16 (default) | float16 | float32
    returns [M, N] out_dtype: the rows of expert e times w[e] as int8_gemm.
    out:       optional [M, N] buffer of out_dtype, written and returned (docs/ops.md, "out= buffers").
    """)

__all__ = defined_in(__name__)
