"""Elementwise / small ops (OPS.md section 2): the public functions and their contracts."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import checks as C
from .. import reference as ref
from ..registry import OpDef, define

__all__ = ["rms_norm", "silu_and_mul", "apply_rope", "hadamard_transform"]


def _check_rms_norm(x, weight, eps):
    op = "rms_norm"
    C.tensor(op, "x", x, min_ndim=1, dtypes=C.FLOAT_DTYPES)
    C.tensor(op, "weight", weight, ndim=1, dtypes=C.FLOAT_DTYPES)
    if weight.shape[0] != x.shape[-1]:
        C.fail(op, "weight", f"shape [{x.shape[-1]}] (the last dim of 'x')", f"shape {list(weight.shape)}")
    if x.shape[-1] == 0:
        C.fail(op, "x", "a last dim >= 1", f"shape {list(x.shape)}")
    C.same_device(op, "x", x, weight=weight)
    C.number(op, "eps", eps, min_value=0.0)


_RMS_NORM = define(OpDef(
    name="rms_norm",
    schema="(Tensor x, Tensor weight, float eps) -> Tensor",
    reference=ref.rms_norm,
    check=_check_rms_norm,
    fake=lambda x, weight, eps: torch.empty_like(x),
    dispatch_arg="x",
    differentiable=True,
))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Root-mean-square normalisation over the last dim.

    x:      [..., D] bfloat16 | float16 | float32
    weight: [D] float (any of the three), same device
    eps:    float >= 0, added to mean(x^2) inside the rsqrt
    returns [..., D] like x: x * rsqrt(mean(x^2, -1) + eps) * weight, computed in float32.
    """
    return _RMS_NORM(x, weight, eps)


def _check_silu_and_mul(x):
    op = "silu_and_mul"
    C.tensor(op, "x", x, min_ndim=1, dtypes=C.FLOAT_DTYPES)
    if x.shape[-1] < 2 or x.shape[-1] % 2 != 0:
        C.fail(op, "x", "an even last dim >= 2 ([gate, up] halves)", f"shape {list(x.shape)}")


_SILU_AND_MUL = define(OpDef(
    name="silu_and_mul",
    schema="(Tensor x) -> Tensor",
    reference=ref.silu_and_mul,
    check=_check_silu_and_mul,
    fake=lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
    dispatch_arg="x",
    differentiable=True,
))


def silu_and_mul(x: Tensor) -> Tensor:
    """The SwiGLU activation of a fused [gate, up] projection.

    x:      [..., 2N] bfloat16 | float16 | float32, the gate in x[..., :N], the up projection in x[..., N:]
    returns [..., N] like x: silu(x[..., :N]) * x[..., N:], computed in float32.
    """
    return _SILU_AND_MUL(x)


def _check_apply_rope(x, positions, theta, interleaved):
    op = "apply_rope"
    C.tensor(op, "x", x, ndim=3, dtypes=C.FLOAT_DTYPES)
    if x.shape[-1] < 2 or x.shape[-1] % 2 != 0:
        C.fail(op, "x", "an even rotary dim R >= 2 in the last dim of [T, H, R]", f"shape {list(x.shape)}")
    C.tensor(op, "positions", positions, ndim=1, dtypes=C.SLOT_DTYPES)
    C.shape(op, "positions", positions, [x.shape[0]])
    C.same_device(op, "x", x, positions=positions)
    C.number(op, "theta", theta, min_value=0.0, exclusive_min=True)
    if not isinstance(interleaved, bool):
        C.fail(op, "interleaved", "a bool", repr(interleaved))


def _setup_rope_backward(ctx, inputs, output):
    x, positions, theta, interleaved = inputs
    ctx.save_for_backward(positions)
    ctx.theta, ctx.interleaved = theta, interleaved


def _rope_backward(ctx, grad):
    # Each pair is rotated by an orthogonal matrix, whose transpose is the rotation by the
    # negated angle: the gradient is the op itself at -positions (exact, since negating an
    # angle is exact), and so runs on whichever backend serves the forward. Through
    # torch.ops so that traced backward graphs keep the op opaque.
    (positions,) = ctx.saved_tensors
    return _APPLY_ROPE.torch_op(grad, -positions, ctx.theta, ctx.interleaved), None, None, None


_APPLY_ROPE = define(OpDef(
    name="apply_rope",
    schema="(Tensor x, Tensor positions, float theta, bool interleaved) -> Tensor",
    reference=ref.apply_rope,
    check=_check_apply_rope,
    fake=lambda x, positions, theta, interleaved: torch.empty_like(x),
    dispatch_arg="x",
    differentiable=True,
    autograd=(_rope_backward, _setup_rope_backward),
))


def apply_rope(x: Tensor, positions: Tensor, theta: float, interleaved: bool = True) -> Tensor:
    """Rotary position embedding of the last dim (callers pass the rope slice).

    x:           [T, H, R] bfloat16 | float16 | float32, R even
    positions:   [T] int32 | int64, same device: the position of each token
    theta:       float > 0, the rope base (GLM-5: 1e6)
    interleaved: True rotates the pairs (x[2i], x[2i+1]) (GLM-5 MLA and indexer),
                 False the half-split (NeoX) pairs (x[i], x[i + R/2])
    returns [T, H, R] like x: each pair (a, b) -> (a cos - b sin, a sin + b cos) with the
    angle positions[t] * theta^(-2i/R), i in [0, R/2), computed in float32.
    """
    return _APPLY_ROPE(x, positions, theta, interleaved)


def _is_power_of_two(n) -> bool:
    # plain arithmetic (no bit tricks) so that it also works on symbolic sizes while tracing
    if n < 1:
        return False
    while n % 2 == 0:
        n = n // 2
    return n == 1


def _check_hadamard_transform(x, scale):
    op = "hadamard_transform"
    C.tensor(op, "x", x, min_ndim=1, dtypes=C.FLOAT_DTYPES)
    if not _is_power_of_two(x.shape[-1]):
        C.fail(op, "x", "a last dim D that is a power of two (1, 2, 4, ...)", f"shape {list(x.shape)}")
    C.number(op, "scale", scale)


def _setup_hadamard_backward(ctx, inputs, output):
    ctx.scale = inputs[1]


def _hadamard_backward(ctx, grad):
    # y = x @ H * scale with H symmetric, so the gradient is grad @ H * scale: the op itself.
    return _HADAMARD_TRANSFORM.torch_op(grad, ctx.scale), None


_HADAMARD_TRANSFORM = define(OpDef(
    name="hadamard_transform",
    schema="(Tensor x, float scale) -> Tensor",
    reference=ref.hadamard_transform,
    check=_check_hadamard_transform,
    fake=lambda x, scale: torch.empty_like(x),
    dispatch_arg="x",
    differentiable=True,
    autograd=(_hadamard_backward, _setup_hadamard_backward),
))


def hadamard_transform(x: Tensor, scale: float) -> Tensor:
    """Walsh-Hadamard rotation of the last dim.

    x:      [..., D] bfloat16 | float16 | float32, D a power of two
    scale:  finite float multiplied into the result (the DSA indexer: D^-0.5, orthonormal)
    returns [..., D] like x: x @ H_D * scale, H_D the Sylvester Hadamard matrix
    (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]), computed in float32.
    """
    return _HADAMARD_TRANSFORM(x, scale)
