"""The elementwise ops (docs/ops/common.md) on the native kernels of csrc/common_ops.cpp.
Inputs are already validated by glm5_hal.ops; these allocate outputs (large ones reused:
backends/cpu/buffers.py), or write into a caller's checked out= buffer, and pass the tensors.
Kept lean: every line here is paid on every call."""
from __future__ import annotations

import torch

from . import cpu
from .buffers import empty, empty_like
from .native import _C, FLOATS, threads


@cpu.impl("rms_norm", dtypes=FLOATS)
def rms_norm(x, weight, eps, *, out=None):
    if out is None:
        out = empty_like(x)
    _C.rms_norm(out, x, weight, eps, threads())
    return out


@cpu.impl("silu_and_mul", dtypes=FLOATS)
def silu_and_mul(x, *, out=None):
    if out is None:
        shape = x.shape
        out = empty((*shape[:-1], shape[-1] // 2), x.dtype)
    _C.silu_and_mul(out, x, threads())
    return out


@cpu.impl("apply_rope", dtypes=FLOATS)
def apply_rope(x, positions, theta, interleaved=True):
    out = empty_like(x)
    _C.apply_rope(out, x, positions, theta, interleaved, threads())
    return out


@cpu.impl("hadamard_transform", dtypes=FLOATS)
def hadamard_transform(x, scale):
    out = empty_like(x)
    _C.hadamard_transform(out, x, scale, threads())
    return out
