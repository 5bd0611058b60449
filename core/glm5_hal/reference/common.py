"""Reference implementations of the elementwise / small ops (OPS.md section 2).

Plain torch on any device. Computation runs in float32, or in float64 when the inputs are
float64 (the conformance suite feeds upcast inputs); results are cast back to the input dtype.
"""
from __future__ import annotations

import torch

__all__ = ["rms_norm"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64, everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    inv_rms = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.to(ct)).to(x.dtype)
