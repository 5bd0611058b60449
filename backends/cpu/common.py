"""The elementwise ops (OPS.md section 2) on the native kernels of csrc/common_ops.cpp.
Inputs are already validated by glm5_hal.ops; these make layouts kernel-ready (copying only
what the kernel cannot address), allocate outputs with torch and pass data pointers."""
from __future__ import annotations

import torch

from . import cpu
from .native import _C, DTYPE_CODE, FLOATS, rows_view, threads


# Contiguous inputs (the usual case) take a fast path: rows = numel / D with a row stride of D,
# and an output shaped like the input, without reshape or view calls (~1-2 us each).
@cpu.impl("rms_norm", dtypes=FLOATS)
def rms_norm(x, weight, eps):
    w = weight if weight.is_contiguous() else weight.contiguous()
    if x.is_contiguous():
        d = x.shape[-1]
        out = torch.empty_like(x)
        _C.rms_norm(out.data_ptr(), x.data_ptr(), w.data_ptr(), x.numel() // d, d, d, d, eps,
                    DTYPE_CODE[x.dtype], DTYPE_CODE[w.dtype], threads())
        return out
    x2 = rows_view(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    _C.rms_norm(out.data_ptr(), x2.data_ptr(), w.data_ptr(), x2.shape[0], x2.shape[1],
                x2.stride(0), x2.shape[1], eps, DTYPE_CODE[x.dtype],
                DTYPE_CODE[w.dtype], threads())
    return out.view(x.shape)


@cpu.impl("silu_and_mul", dtypes=FLOATS)
def silu_and_mul(x):
    n = x.shape[-1] // 2
    if x.is_contiguous():
        out = x.new_empty((*x.shape[:-1], n))
        _C.silu_and_mul(out.data_ptr(), x.data_ptr(), x.numel() // (2 * n), n, 2 * n, n,
                        DTYPE_CODE[x.dtype], threads())
        return out
    x2 = rows_view(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype)
    _C.silu_and_mul(out.data_ptr(), x2.data_ptr(), x2.shape[0], n, x2.stride(0), n,
                    DTYPE_CODE[x.dtype], threads())
    return out.view(*x.shape[:-1], n)


@cpu.impl("apply_rope", dtypes=FLOATS)
def apply_rope(x, positions, theta, interleaved=True):
    if x.stride(2) != 1:
        x = x.contiguous()
    if not positions.is_contiguous():
        positions = positions.contiguous()
    t, h, r = x.shape
    out = torch.empty((t, h, r), dtype=x.dtype)
    _C.apply_rope(out.data_ptr(), x.data_ptr(), positions.data_ptr(), DTYPE_CODE[positions.dtype],
                  t, h, r, x.stride(0), x.stride(1), h * r, r, theta, interleaved,
                  DTYPE_CODE[x.dtype], threads())
    return out


@cpu.impl("hadamard_transform", dtypes=FLOATS)
def hadamard_transform(x, scale):
    if x.is_contiguous():
        d = x.shape[-1]
        out = torch.empty_like(x)
        _C.hadamard_transform(out.data_ptr(), x.data_ptr(), x.numel() // d, d, d, d, scale,
                              DTYPE_CODE[x.dtype], threads())
        return out
    x2 = rows_view(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    _C.hadamard_transform(out.data_ptr(), x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0),
                          x2.shape[1], scale, DTYPE_CODE[x.dtype], threads())
    return out.view(x.shape)
