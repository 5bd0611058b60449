"""Reference implementations of the elementwise / small ops (docs/ops/common.md).

Plain torch on any device. Computation runs in float32, or in float64 when the inputs are
float64 (the conformance suite feeds upcast inputs); results are cast back to the input dtype.
"""
from __future__ import annotations

import torch

__all__ = ["rms_norm", "silu_and_mul", "apply_rope", "hadamard_transform"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64, everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    inv_rms = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.to(ct)).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    gate, up = x.to(ct).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def rope_angles(positions: torch.Tensor, rot_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """`[T, rot_dim/2]` angles `positions[t] * theta^(-2i/rot_dim)` in `dtype`."""
    exponents = torch.arange(rot_dim // 2, device=positions.device, dtype=dtype) * (-2.0 / rot_dim)
    inv_freq = torch.pow(float(theta), exponents)
    return positions.to(dtype)[:, None] * inv_freq[None, :]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool = True
               ) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    angles = rope_angles(positions, x.shape[-1], theta, ct)[:, None, :]  # broadcast over heads
    cos, sin = angles.cos(), angles.sin()
    xf = x.to(ct)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:
        a, b = xf[..., :half], xf[..., half:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
    return out.to(x.dtype)


def hadamard_transform(x: torch.Tensor, scale: float) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    lead, dim = x.shape[:-1], x.shape[-1]
    y = x.to(ct)
    # Fast Walsh-Hadamard butterfly: at stride h, (a, b) -> (a + b, a - b) for the pairs
    # (j, j + h) inside each block of 2h. Doubling h from 1 builds H_2n = [[H, H], [H, -H]]
    # from the inside out, i.e. Sylvester's (natural) order; H is symmetric, so H x = x H.
    h = 1
    while h < dim:
        y = y.reshape(*lead, dim // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(*lead, dim) * scale).to(x.dtype)
