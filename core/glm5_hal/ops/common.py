"""Elementwise / small ops (docs/ops/common.md)."""
from __future__ import annotations

import torch

from .. import reference as ref
from ..checks import FLOAT_DTYPES as FLOAT, SLOT_DTYPES
from ..contract import Bool, Number, Out, Rule, Tensor
from ..opdef import define, defined_in

rms_norm = define(
    ref.rms_norm,
    args=dict(x=Tensor("..., D", FLOAT), weight=Tensor("D", FLOAT), eps=Number(min=0.0)),
    rules=[Rule("x", "D >= 1", "a last dim >= 1")],
    fake=lambda x, weight, eps: torch.empty_like(x),
    out=Out("..., D", dtype="x"),
    differentiable=True,
    doc="""Root-mean-square normalisation over the last dim.

    x:      [..., D] bfloat16 | float16 | float32
    weight: [D] float (any of the three), same device
    eps:    float >= 0, added to mean(x^2) inside the rsqrt
    returns [..., D] like x: x * rsqrt(mean(x^2, -1) + eps) * weight, computed in float32.
    out:    optional [..., D] buffer of x's dtype, written and returned (docs/ops.md, "out= buffers").
    """)

silu_and_mul = define(
    ref.silu_and_mul,
    args=dict(x=Tensor("..., N2", FLOAT)),
    rules=[Rule("x", "N2 >= 2 and N2 % 2 == 0", "an even last dim >= 2 ([gate, up] halves)")],
    fake=lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
    out=Out("..., N2 // 2", dtype="x"),
    differentiable=True,
    doc="""The SwiGLU activation of a fused [gate, up] projection.

    x:      [..., 2N] bfloat16 | float16 | float32, the gate in x[..., :N], the up projection in x[..., N:]
    returns [..., N] like x: silu(x[..., :N]) * x[..., N:], computed in float32.
    out:    optional [..., N] buffer of x's dtype, written and returned (docs/ops.md, "out= buffers").
    """)


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
    return apply_rope.op.torch_op(grad, -positions, ctx.theta, ctx.interleaved), None, None, None


def _rope_jvp(inputs, tangents):
    # linear in x: the tangent is the op applied to x's tangent
    x, positions, theta, interleaved = inputs
    return None if tangents[0] is None else apply_rope.op.torch_op(tangents[0], positions, theta, interleaved)


apply_rope = define(
    ref.apply_rope,
    args=dict(x=Tensor("T, H, R", FLOAT), positions=Tensor("T", SLOT_DTYPES),
              theta=Number(gt=0.0), interleaved=Bool()),
    rules=[Rule("x", "R >= 2 and R % 2 == 0", "an even rotary dim R >= 2 in the last dim of [T, H, R]")],
    fake=lambda x, positions, theta, interleaved: torch.empty_like(x),
    autograd=(_rope_backward, _setup_rope_backward, _rope_jvp),
    doc="""Rotary position embedding of the last dim (callers pass the rope slice).

    x:           [T, H, R] bfloat16 | float16 | float32, R even
    positions:   [T] int32 | int64, same device: the position of each token
    theta:       float > 0, the rope base (GLM-5: 1e6)
    interleaved: True rotates the pairs (x[2i], x[2i+1]) (GLM-5 MLA and indexer),
                 False the half-split (NeoX) pairs (x[i], x[i + R/2])
    returns [T, H, R] like x: each pair (a, b) -> (a cos - b sin, a sin + b cos) with the
    angle positions[t] * theta^(-2i/R), i in [0, R/2), computed in float32.
    """)


def _setup_hadamard_backward(ctx, inputs, output):
    ctx.scale = inputs[1]


def _hadamard_backward(ctx, grad):
    # y = x @ H * scale with H symmetric, so the gradient is grad @ H * scale: the op itself.
    return hadamard_transform.op.torch_op(grad, ctx.scale), None


def _hadamard_jvp(inputs, tangents):
    return None if tangents[0] is None else hadamard_transform.op.torch_op(tangents[0], inputs[1])


hadamard_transform = define(
    ref.hadamard_transform,
    args=dict(x=Tensor("..., D", FLOAT), scale=Number()),
    rules=[Rule("x", "is_power_of_two(D)", "a last dim D that is a power of two (1, 2, 4, ...)")],
    fake=lambda x, scale: torch.empty_like(x),
    autograd=(_hadamard_backward, _setup_hadamard_backward, _hadamard_jvp),
    doc="""Walsh-Hadamard rotation of the last dim.

    x:      [..., D] bfloat16 | float16 | float32, D a power of two
    scale:  finite float multiplied into the result (the DSA indexer: D^-0.5, orthonormal)
    returns [..., D] like x: x @ H_D * scale, H_D the Sylvester Hadamard matrix
    (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]), computed in float32.
    """)

__all__ = defined_in(__name__)
