"""Every differentiable op's gradient, checked independently of the reference's own VJP.

The backward that `glm5_hal.ops` registers (the reference's VJP, or the op's own) is run in
float32 and compared with central finite differences of the op's *forward* contract, the
reference evaluated in float64 (gradcheck's numerical Jacobian, one element at a time). The
straight-through int4_fake_quant is checked against its hand-derived gradient (the upstream
gradient itself). Each check is shown to fail on a deliberately broken gradient.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import pytest
import torch

import glm5_hal as hal
from glm5_hal import reference as ref
from glm5_hal.opdef import OPS

from conftest import seeded

EPS = 1e-6          # float64 central differences: truncation ~EPS^2, rounding ~1e-16 / EPS
RTOL, ATOL = 2e-4, 2e-5   # the float32 backward against them


@dataclasses.dataclass
class Grad:
    """`op(*args)` differentiated with respect to the tensor arguments at positions `wrt`."""
    op: str
    make: Callable[[torch.Generator], tuple]
    wrt: tuple[int, ...]
    eps: float = EPS


def _routed(g, tokens, k, experts):
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).int()


def _permuted(g):
    ids = _routed(g, 4, 2, 3)
    ids[1, 0] = -1                      # a dropped slot
    return torch.randn(4, 6, generator=g), ids, 3


def _unpermuted(g):
    ids = _routed(g, 4, 2, 3)
    _, counts, src = ref.moe_permute(torch.zeros(4, 1), ids, 3)
    return torch.randn(src.numel(), 5, generator=g), src, torch.rand(4, 2, generator=g) + 0.1


def _grouped(g):
    counts = torch.tensor([2, 0, 3], dtype=torch.int32)   # a zero-row expert in the middle
    return torch.randn(5, 6, generator=g), torch.randn(3, 4, 6, generator=g) / 3, counts


def _w4a16(g):
    packed, scale = ref.int4_pack(torch.randn(5, 16, generator=g), 8)
    return torch.randn(3, 16, generator=g), packed, scale, 8


def _indexer(g):
    t, s = 3, 7
    return (torch.randn(t, 2, 8, generator=g), torch.randn(s, 8, generator=g), torch.randn(t, 2, generator=g) / 4,
            torch.tensor([0, 2, 0], dtype=torch.int32), torch.tensor([4, 7, 0], dtype=torch.int32))


def _sparse(g):
    indices = torch.tensor([[0, 3, -1, 3], [5, 1, 2, 9], [-1, -1, -1, -1]], dtype=torch.int32)
    return (torch.randn(3, 2, 12, generator=g), torch.randn(6, 12, generator=g) / 2, indices, 12 ** -0.5, 8)


GRADS = {g.op: g for g in (
    Grad("rms_norm", lambda g: (torch.randn(3, 8, generator=g), torch.rand(8, generator=g) + 0.5, 1e-5), (0, 1)),
    Grad("silu_and_mul", lambda g: (torch.randn(3, 10, generator=g) * 2,), (0,)),
    Grad("apply_rope", lambda g: (torch.randn(3, 2, 8, generator=g), torch.tensor([0, 5, 1000], dtype=torch.int32),
                                  1e4, True), (0,)),
    Grad("hadamard_transform", lambda g: (torch.randn(3, 8, generator=g), 8 ** -0.5), (0,)),
    # linear in x and in scale, so a large step is exact; the reference dequantizes with
    # scale.float(), which would round a 1e-6 step of a float64 scale
    Grad("w4a16_gemm", _w4a16, (0, 2), eps=1e-2),
    Grad("moe_permute", _permuted, (0,)),
    Grad("moe_unpermute", _unpermuted, (0, 2)),
    Grad("grouped_gemm", _grouped, (0, 1)),
    Grad("indexer_logits", _indexer, (0, 1, 2)),
    Grad("sparse_mla_attention", _sparse, (0, 1)),
)}
STRAIGHT_THROUGH = {"int4_fake_quant"}   # gradient by contract, not the forward's derivative


def differentiable_ops() -> set[str]:
    hal.ops.rms_norm  # noqa: B018  (defines every op)
    return {name for name, op in OPS.items() if op.differentiable}


def test_every_differentiable_op_has_a_gradient_check():
    assert differentiable_ops() == set(GRADS) | STRAIGHT_THROUGH


# -- the check -------------------------------------------------------------------------------
def _outputs(result) -> list[torch.Tensor]:
    """The floating outputs, in order (index and count outputs carry no gradient)."""
    outs = result if isinstance(result, tuple) else (result,)
    return [o for o in outs if o.is_floating_point()]


def gradient_mismatch(fn: Callable, case: Grad, seed: int = 0) -> str:
    """'' if the gradient of `fn` (float32, its backward) equals the finite differences of the
    op's float64 reference forward; else what differs."""
    args = case.make(seeded(seed))
    reference = getattr(ref, case.op)
    with torch.no_grad():
        shapes = [o.shape for o in _outputs(reference(*args))]
    g = seeded(seed + 1)
    cotangents = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]

    def loss64(*a) -> float:   # <cotangent, output>, ignoring non-finite entries (-inf logits, lse)
        with torch.no_grad():
            outs = _outputs(reference(*a))
        return sum(float(torch.where(o.isfinite(), o * c, 0).sum()) for o, c in zip(outs, cotangents))

    x64 = [a.double() if i in case.wrt else a for i, a in enumerate(args)]
    leaves = [args[i].detach().float().requires_grad_() for i in case.wrt]
    call = list(args)
    for i, leaf in zip(case.wrt, leaves):
        call[i] = leaf
    outs = _outputs(fn(*call))
    pairs = [(o, torch.where(o.isfinite(), c, 0).float()) for o, c in zip(outs, cotangents) if o.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True) if pairs \
        else [None] * len(leaves)
    problems = []
    for i, leaf, analytic in zip(case.wrt, leaves, got):
        analytic = torch.zeros_like(leaf) if analytic is None else analytic.reshape(leaf.shape).contiguous()
        numeric = torch.empty(leaf.shape, dtype=torch.float64)
        base = x64[i]
        for j in range(base.numel()):
            plus, minus = base.clone(), base.clone()
            plus.view(-1)[j] += case.eps
            minus.view(-1)[j] -= case.eps
            numeric.view(-1)[j] = (loss64(*x64[:i], plus, *x64[i + 1:]) -
                                   loss64(*x64[:i], minus, *x64[i + 1:])) / (2 * case.eps)
        bad = (analytic.double() - numeric).abs() > ATOL + RTOL * numeric.abs()
        if bad.any():
            j = int(bad.flatten().nonzero()[0])
            problems.append(f"argument {i}: {int(bad.sum())} of {bad.numel()} elements differ, e.g. "
                            f"[{j}] backward {float(analytic.view(-1)[j]):.6g} vs finite differences "
                            f"{float(numeric.view(-1)[j]):.6g}")
    return "; ".join(problems)


@pytest.mark.parametrize("op", sorted(GRADS))
def test_the_registered_backward_matches_finite_differences(op):
    assert gradient_mismatch(getattr(hal.ops, op), GRADS[op]) == ""


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_backward_in_both_pairings(interleaved):
    case = dataclasses.replace(GRADS["apply_rope"], make=lambda g: (
        torch.randn(3, 2, 8, generator=g), torch.tensor([0, -7, 202751], dtype=torch.int32), 1e6, interleaved))
    assert gradient_mismatch(hal.ops.apply_rope, case) == ""


def test_int4_fake_quant_passes_the_gradient_straight_through():
    w = torch.randn(4, 16, generator=seeded(5)).requires_grad_()
    upstream = torch.randn(4, 16, generator=seeded(6))
    hal.ops.int4_fake_quant(w, 8).backward(upstream)
    assert torch.equal(w.grad, upstream)


# -- deliberately broken gradients: the check must catch each ----------------------------------
def _straight(value: torch.Tensor, gradient_of: torch.Tensor) -> torch.Tensor:
    """`value` forward, the gradient of `gradient_of` backward."""
    return gradient_of + (value - gradient_of).detach()


def rms_norm_constant_rsqrt(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps).detach() * w


def silu_and_mul_constant_sigmoid(x):
    gate, up = x.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate).detach() * up


class _RopeForwardAngle(torch.autograd.Function):
    """rope whose backward rotates by +angle (the transpose forgotten)."""
    @staticmethod
    def forward(ctx, x, positions, theta, interleaved):
        ctx.save_for_backward(positions)
        ctx.theta, ctx.interleaved = theta, interleaved
        return ref.apply_rope(x, positions, theta, interleaved)

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        return ref.apply_rope(grad, positions, ctx.theta, ctx.interleaved), None, None, None


class _HadamardUnscaledBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        return ref.hadamard_transform(x, scale)

    @staticmethod
    def backward(ctx, grad):
        return ref.hadamard_transform(grad, 1.0), None


def w4a16_constant_scale(x, packed, scale, group_size):
    return ref.w4a16_gemm(x, packed, scale.detach(), group_size)


class _PermuteToFlatIndex(torch.autograd.Function):
    """moe_permute whose backward sends row r's gradient to token src[r] % T instead of src[r] // k."""
    @staticmethod
    def forward(ctx, x, ids, num_experts):
        out, counts, src = ref.moe_permute(x, ids, num_experts)
        ctx.save_for_backward(src)
        ctx.tokens = x.shape[0]
        return out, counts, src

    @staticmethod
    def backward(ctx, grad, *_):
        (src,) = ctx.saved_tensors
        return grad.new_zeros(ctx.tokens, grad.shape[1]).index_add_(0, src.long() % ctx.tokens, grad), None, None


def unpermute_constant_weights(y, src, weights):
    return ref.moe_unpermute(y, src, weights.detach())


def grouped_gemm_constant_weights(x, w, counts):
    return ref.grouped_gemm(x, w.detach(), counts)


def indexer_logits_without_relu_mask(q, k, weights, k_start, k_end):
    dots = torch.einsum("thd,sd->ths", q, k)
    logits = torch.einsum("th,ths->ts", weights, _straight(dots.relu(), dots))
    s = torch.arange(k.shape[0])
    in_range = (s >= k_start[:, None].long()) & (s < k_end[:, None].long())
    return logits.masked_fill(~in_range, -math.inf)


def sparse_attention_constant_lse(q, kv, indices, sm_scale, d_v):
    out, lse = ref.sparse_mla_attention(q, kv, indices, sm_scale, d_v)
    return out, lse.detach()


BROKEN = {
    "rms_norm": rms_norm_constant_rsqrt,
    "silu_and_mul": silu_and_mul_constant_sigmoid,
    "apply_rope": _RopeForwardAngle.apply,
    "hadamard_transform": _HadamardUnscaledBackward.apply,
    "w4a16_gemm": w4a16_constant_scale,
    "moe_permute": _PermuteToFlatIndex.apply,
    "moe_unpermute": unpermute_constant_weights,
    "grouped_gemm": grouped_gemm_constant_weights,
    "indexer_logits": indexer_logits_without_relu_mask,
    "sparse_mla_attention": sparse_attention_constant_lse,
}


@pytest.mark.parametrize("op", sorted(BROKEN))
def test_a_broken_gradient_is_caught(op):
    assert set(BROKEN) == set(GRADS)
    assert "elements differ" in gradient_mismatch(BROKEN[op], GRADS[op])


def test_int4_fake_quant_differentiated_through_its_forward_is_not_straight_through():
    w = torch.randn(4, 16, generator=seeded(5)).requires_grad_()
    ref.int4_fake_quant(w, 8).backward(torch.ones(4, 16))   # round() has no gradient
    assert w.grad is None or not torch.equal(w.grad, torch.ones(4, 16))
