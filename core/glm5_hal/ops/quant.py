"""Quantization ops (OPS.md section 3): FP8 block quantization and the symmetric INT4 weight
format (fake-quant for QAT, packing, unpacking, the W4A16 GEMM)."""
from __future__ import annotations

import torch

from .. import reference as ref
from ..checks import FLOAT_DTYPES as FLOAT, FP8
from ..contract import Choice, Int, Let, Rule, Tensor
from ..opdef import define, defined_in

SCALE_FORMATS = (None, "ue8m0")
NIBBLES_PER_WORD = 8
F32, I32 = (torch.float32,), (torch.int32,)

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


int4_fake_quant = define(
    ref.int4_fake_quant,
    args=dict(w=Tensor("N, K", FLOAT), group_size=Int(min=1)),
    rules=[_divides("group_size", "the last dim of 'w'")],
    fake=lambda w, group_size: torch.empty_like(w),
    autograd=(_straight_through_backward, _setup_straight_through),
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
    differentiable=True,
    doc="""Activations times a packed INT4 weight, transposed (a linear layer).

    x:          [M, K] bfloat16 | float16 | float32, K divisible by 8
    packed:     [N, K / 8] int32 (int4_pack layout), same device
    scale:      [N, K / group_size] float32, same device
    group_size: int >= 1 dividing K
    returns [M, N] like x: x @ int4_unpack(packed, scale, group_size)^T, float32 accumulation.
    Differentiable w.r.t. x (and scale).
    """)

__all__ = defined_in(__name__)
