"""Python wrappers of the native elementwise kernels (OPS.md section 2): inputs are already
validated by glm5_hal.ops; these make layouts kernel-ready (copying only what the kernel
cannot address), allocate outputs with torch and pass data pointers. Kept lean: every line
here is paid on every call."""
from __future__ import annotations

import torch

from . import cpu

try:
    from glm5_hal import _C
except ImportError:  # the probe reports it; these kernels are then never chosen
    _C = None

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
# glm5::DType codes (csrc/core.h)
DTYPE_CODE = {_F32: 0, _F16: 1, _BF16: 2, torch.float8_e4m3fn: 3, torch.int32: 4, torch.int64: 5}
FLOATS = (_F32, _F16, _BF16)
_threads = torch.get_num_threads


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last] with a unit stride along the last dim (copies only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


# Contiguous inputs (the usual case) take a fast path: rows = numel / D with a row stride of D,
# and an output shaped like the input, without reshape or view calls (~1-2 us each).
@cpu.impl("rms_norm", dtypes=FLOATS)
def rms_norm(x, weight, eps):
    w = weight if weight.is_contiguous() else weight.contiguous()
    if x.is_contiguous():
        d = x.shape[-1]
        out = torch.empty_like(x)
        _C.rms_norm(out.data_ptr(), x.data_ptr(), w.data_ptr(), x.numel() // d, d, d, d, eps,
                    DTYPE_CODE[x.dtype], DTYPE_CODE[w.dtype], _threads())
        return out
    x2 = rows_view(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    _C.rms_norm(out.data_ptr(), x2.data_ptr(), w.data_ptr(), x2.shape[0], x2.shape[1],
                x2.stride(0), x2.shape[1], eps, DTYPE_CODE[x.dtype],
                DTYPE_CODE[w.dtype], _threads())
    return out.view(x.shape)


@cpu.impl("silu_and_mul", dtypes=FLOATS)
def silu_and_mul(x):
    n = x.shape[-1] // 2
    if x.is_contiguous():
        out = x.new_empty((*x.shape[:-1], n))
        _C.silu_and_mul(out.data_ptr(), x.data_ptr(), x.numel() // (2 * n), n, 2 * n, n,
                        DTYPE_CODE[x.dtype], _threads())
        return out
    x2 = rows_view(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype)
    _C.silu_and_mul(out.data_ptr(), x2.data_ptr(), x2.shape[0], n, x2.stride(0), n,
                    DTYPE_CODE[x.dtype], _threads())
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
                  DTYPE_CODE[x.dtype], _threads())
    return out


@cpu.impl("hadamard_transform", dtypes=FLOATS)
def hadamard_transform(x, scale):
    if x.is_contiguous():
        d = x.shape[-1]
        out = torch.empty_like(x)
        _C.hadamard_transform(out.data_ptr(), x.data_ptr(), x.numel() // d, d, d, d, scale,
                              DTYPE_CODE[x.dtype], _threads())
        return out
    x2 = rows_view(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    _C.hadamard_transform(out.data_ptr(), x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0),
                          x2.shape[1], scale, DTYPE_CODE[x.dtype], _threads())
    return out.view(x.shape)
