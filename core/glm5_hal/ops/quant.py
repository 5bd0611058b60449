"""Public quantization ops (OPS.md section 3): FP8 block quantization and the symmetric
INT4 weight format (fake-quant for QAT, packing, unpacking, the W4A16 GEMM)."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import checks as C
from .. import reference as ref
from ..registry import OpDef, define

__all__ = ["fp8_block_quant", "int4_fake_quant", "int4_pack", "int4_unpack", "w4a16_gemm"]

SCALE_FORMATS = (None, "ue8m0")
NIBBLES_PER_WORD = 8


def _check_divides(op: str, arg: str, divisor: int, k, what: str) -> None:
    if k % divisor != 0:
        C.fail(op, arg, f"a divisor of K = {k} ({what})", divisor)


def _check_fp8_block_quant(x, block, scale_fmt):
    op = "fp8_block_quant"
    C.tensor(op, "x", x, min_ndim=1, dtypes=C.FLOAT_DTYPES)
    C.integer(op, "block", block, min_value=1)
    _check_divides(op, "block", block, x.shape[-1], "the last dim of 'x'")
    C.choice(op, "scale_fmt", scale_fmt, SCALE_FORMATS)


def _fake_fp8_block_quant(x, block, scale_fmt):
    return (torch.empty(x.shape, dtype=C.FP8, device=x.device),
            x.new_empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.float32))


_FP8_BLOCK_QUANT = define(OpDef(
    name="fp8_block_quant",
    schema="(Tensor x, int block, str? scale_fmt) -> (Tensor, Tensor)",
    reference=ref.fp8_block_quant,
    check=_check_fp8_block_quant,
    fake=_fake_fp8_block_quant,
    dispatch_arg="x",
))


def fp8_block_quant(x: Tensor, block: int = 128, scale_fmt: str | None = None) -> tuple[Tensor, Tensor]:
    """Per-block FP8 (e4m3) quantization along the last dim.

    x:         [..., K] bfloat16 | float16 | float32
    block:     int >= 1 dividing K: the number of consecutive elements sharing one scale
    scale_fmt: None (scale = amax / 448) or "ue8m0" (scale rounded up to a power of two)
    returns (q float8_e4m3fn [..., K], scale float32 [..., K / block]) with
    amax = max(max |x_block|, 1e-4), q = clamp(x / scale, -448, 448) rounded to nearest even;
    q.float() * scale dequantizes.
    """
    return _FP8_BLOCK_QUANT(x, block, scale_fmt)


def _check_int4_weight(op: str, w, group_size, *, packing: bool) -> None:
    C.tensor(op, "w", w, ndim=2, dtypes=C.FLOAT_DTYPES)
    if packing and w.shape[1] % NIBBLES_PER_WORD != 0:
        C.fail(op, "w", f"a last dim K divisible by {NIBBLES_PER_WORD} (nibbles per int32 word)",
               f"shape {list(w.shape)}")
    C.integer(op, "group_size", group_size, min_value=1)
    _check_divides(op, "group_size", group_size, w.shape[1], "the last dim of 'w'")


def _check_int4_fake_quant(w, group_size):
    _check_int4_weight("int4_fake_quant", w, group_size, packing=False)


def _setup_straight_through(ctx, inputs, output):
    pass  # the backward needs nothing: the gradient passes through unchanged


def _straight_through_backward(ctx, grad):
    return grad, None


_INT4_FAKE_QUANT = define(OpDef(
    name="int4_fake_quant",
    schema="(Tensor w, int group_size) -> Tensor",
    reference=ref.int4_fake_quant,
    check=_check_int4_fake_quant,
    fake=lambda w, group_size: torch.empty_like(w),
    dispatch_arg="w",
    autograd=(_straight_through_backward, _setup_straight_through),
))


def int4_fake_quant(w: Tensor, group_size: int) -> Tensor:
    """Quantize-dequantize to the symmetric INT4 grid (QAT forward); straight-through backward.

    w:          [N, K] bfloat16 | float16 | float32
    group_size: int >= 1 dividing K: consecutive elements of a row sharing one scale
    returns [N, K] like w: per group s = max(amax / 7, 1e-5), q = clamp(round(w / s), -7, 7)
    (round half to even), result q * s computed in float32. The gradient w.r.t. w is the
    upstream gradient, unchanged.
    """
    return _INT4_FAKE_QUANT(w, group_size)


def _check_int4_pack(w, group_size):
    _check_int4_weight("int4_pack", w, group_size, packing=True)


_INT4_PACK = define(OpDef(
    name="int4_pack",
    schema="(Tensor w, int group_size) -> (Tensor, Tensor)",
    reference=ref.int4_pack,
    check=_check_int4_pack,
    fake=lambda w, group_size: (
        w.new_empty((w.shape[0], w.shape[1] // NIBBLES_PER_WORD), dtype=torch.int32),
        w.new_empty((w.shape[0], w.shape[1] // group_size), dtype=torch.float32)),
    dispatch_arg="w",
))


def int4_pack(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Quantize to symmetric INT4 and pack 8 nibbles per int32 (compressed-tensors
    "pack-quantized" order).

    w:          [N, K] bfloat16 | float16 | float32, K divisible by 8
    group_size: int >= 1 dividing K
    returns (packed int32 [N, K / 8], scale float32 [N, K / group_size]): s and q as in
    int4_fake_quant; nibble u = q + 8 of element 8j + i of a row sits in bits 4i..4i+3 of
    packed[:, j] (bit 31 set makes the int32 negative).
    """
    return _INT4_PACK(w, group_size)


def _check_packed_weight(op: str, packed, scale, group_size, k) -> None:
    """`group_size` dividing K and `scale [N, K/group_size]` float32, for a checked `packed`."""
    C.integer(op, "group_size", group_size, min_value=1)
    _check_divides(op, "group_size", group_size, k, f"{NIBBLES_PER_WORD} * packed.shape[1]")
    C.tensor(op, "scale", scale, ndim=2, dtypes=(torch.float32,))
    C.shape(op, "scale", scale, [packed.shape[0], k // group_size])


def _check_int4_unpack(packed, scale, group_size):
    op = "int4_unpack"
    C.tensor(op, "packed", packed, ndim=2, dtypes=(torch.int32,))
    _check_packed_weight(op, packed, scale, group_size, packed.shape[1] * NIBBLES_PER_WORD)
    C.same_device(op, "packed", packed, scale=scale)


_INT4_UNPACK = define(OpDef(
    name="int4_unpack",
    schema="(Tensor packed, Tensor scale, int group_size) -> Tensor",
    reference=ref.int4_unpack,
    check=_check_int4_unpack,
    fake=lambda packed, scale, group_size: packed.new_empty(
        (packed.shape[0], packed.shape[1] * NIBBLES_PER_WORD), dtype=torch.float32),
    dispatch_arg="packed",
))


def int4_unpack(packed: Tensor, scale: Tensor, group_size: int) -> Tensor:
    """The dequantized weight of an int4_pack result (its exact inverse).

    packed:     [N, K / 8] int32
    scale:      [N, K / group_size] float32, same device
    group_size: int >= 1 dividing K = 8 * packed.shape[1]
    returns [N, K] float32: (u - 8) * scale of the element's group, u its nibble.
    """
    return _INT4_UNPACK(packed, scale, group_size)


def _check_w4a16_gemm(x, packed, scale, group_size):
    op = "w4a16_gemm"
    C.tensor(op, "x", x, ndim=2, dtypes=C.FLOAT_DTYPES)
    k = x.shape[1]
    if k % NIBBLES_PER_WORD != 0:
        C.fail(op, "x", f"a last dim K divisible by {NIBBLES_PER_WORD} (nibbles per int32 word)",
               f"shape {list(x.shape)}")
    C.tensor(op, "packed", packed, ndim=2, dtypes=(torch.int32,))
    C.shape(op, "packed", packed, [None, k // NIBBLES_PER_WORD])
    _check_packed_weight(op, packed, scale, group_size, k)
    C.same_device(op, "x", x, packed=packed, scale=scale)


_W4A16_GEMM = define(OpDef(
    name="w4a16_gemm",
    schema="(Tensor x, Tensor packed, Tensor scale, int group_size) -> Tensor",
    reference=ref.w4a16_gemm,
    check=_check_w4a16_gemm,
    fake=lambda x, packed, scale, group_size: x.new_empty((x.shape[0], packed.shape[0])),
    dispatch_arg="x",
    differentiable=True,
))


def w4a16_gemm(x: Tensor, packed: Tensor, scale: Tensor, group_size: int) -> Tensor:
    """Activations times a packed INT4 weight, transposed (a linear layer).

    x:          [M, K] bfloat16 | float16 | float32, K divisible by 8
    packed:     [N, K / 8] int32 (int4_pack layout), same device
    scale:      [N, K / group_size] float32, same device
    group_size: int >= 1 dividing K
    returns [M, N] like x: x @ int4_unpack(packed, scale, group_size)^T, float32 accumulation.
    Differentiable w.r.t. x (and scale).
    """
    return _W4A16_GEMM(x, packed, scale, group_size)
