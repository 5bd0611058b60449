"""Elementwise / small ops (OPS.md section 2): the public functions and their contracts."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import checks as C
from .. import reference as ref
from ..registry import OpDef, define

__all__ = ["rms_norm"]


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
