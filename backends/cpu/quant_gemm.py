"""The GEMMs on the checkpoint formats (OPS.md section 3.1) and int8_quant on the cpu backend:
native kernels (csrc/qgemm.cpp, csrc/quant.cpp). Inputs are already validated by glm5_hal.ops;
these give the kernels a unit stride along K (copying only what is strided there), contiguous
scales, and fresh outputs."""
from __future__ import annotations

import torch

from . import cpu
from .native import _C, FLOATS, threads as _threads

# The dtype codes of csrc/core.h's DType (the raw-pointer bindings of csrc/qgemm.h take codes).
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.int32: 4,
              torch.int64: 5}


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last] with a unit stride along the last dim (copies only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2.contiguous() if t2.shape[1] > 1 and t2.stride(1) != 1 else t2

_FP8, _I8, _I32 = torch.float8_e4m3fn, torch.int8, torch.int32
_CODES = {**DTYPE_CODE, _I8: 6}
# the grouped entry point's kinds
_FP8_KIND, _INT8_KIND, BF16_KIND = 0, 1, 2


def _unit_k(t: torch.Tensor) -> torch.Tensor:
    """`t` with a unit stride along its last dim (K)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def grouped(kind: int, a, a_scale, w, w_scale, tokens_per_expert, out_dtype):
    """One native call for the grouped GEMMs (FP8, INT8, bfloat16); the kernel validates the
    counts (>= 0, summing to M) before it writes anything."""
    a, w = _unit_k(a), _unit_k(w)
    a_scale, w_scale, counts = _dense(a_scale), _dense(w_scale), _dense(tokens_per_expert)
    m, k = a.shape
    e, n = w.shape[0], w.shape[1]
    out = torch.empty((m, n), dtype=out_dtype)
    _C.grouped_gemm(kind, out.data_ptr(), _CODES[out_dtype], n, a.data_ptr(), m, k, a.stride(0),
                    0 if a_scale is None else a_scale.data_ptr(), w.data_ptr(), e, n, w.stride(0), w.stride(1),
                    0 if w_scale is None else w_scale.data_ptr(), counts.data_ptr(), _threads())
    return out


@cpu.impl("fp8_block_gemm", dtypes=(_FP8,))
def fp8_block_gemm(a, a_scale, w, w_scale, out_dtype=torch.bfloat16):
    a, w, a_scale, w_scale = _unit_k(a), _unit_k(w), _dense(a_scale), _dense(w_scale)
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype)
    _C.fp8_block_gemm(out.data_ptr(), _CODES[out_dtype], n, a.data_ptr(), m, k, a.stride(0), a_scale.data_ptr(),
                      w.data_ptr(), n, w.stride(0), w_scale.data_ptr(), _threads())
    return out


# validates_values: the kernel checks tokens_per_expert itself, before writing (csrc/qgemm.cpp).
@cpu.impl("fp8_grouped_gemm", dtypes=(_FP8,), validates_values=True)
def fp8_grouped_gemm(a, a_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16):
    return grouped(_FP8_KIND, a, a_scale, w, w_scale, tokens_per_expert, out_dtype)


@cpu.impl("int8_quant", dtypes=FLOATS)
def int8_quant(x):
    x2 = rows_view(x)
    rows, cols = x2.shape
    q = torch.empty((rows, cols), dtype=_I8)
    scale = torch.empty(rows, dtype=torch.float32)
    _C.int8_quant(q.data_ptr(), scale.data_ptr(), x2.data_ptr(), rows, cols, x2.stride(0), DTYPE_CODE[x.dtype],
                  _threads())
    return q.view(x.shape), scale.view(x.shape[:-1])


@cpu.impl("int8_gemm", dtypes=(_I8,))
def int8_gemm(x, x_scale, w, w_scale, out_dtype=torch.bfloat16, bias=None):
    x, w, x_scale, w_scale, bias = _unit_k(x), _unit_k(w), _dense(x_scale), _dense(w_scale), _dense(bias)
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype)
    _C.int8_gemm(out.data_ptr(), _CODES[out_dtype], n, x.data_ptr(), m, k, x.stride(0), x_scale.data_ptr(),
                 w.data_ptr(), n, w.stride(0), w_scale.data_ptr(), 0 if bias is None else bias.data_ptr(),
                 _threads())
    return out


@cpu.impl("int8_grouped_gemm", dtypes=(_I8,), validates_values=True)
def int8_grouped_gemm(x, x_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16):
    return grouped(_INT8_KIND, x, x_scale, w, w_scale, tokens_per_expert, out_dtype)
