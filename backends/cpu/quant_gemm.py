"""The GEMMs on the checkpoint formats (docs/ops/quant.md) and int8_quant on the cpu backend:
native kernels (csrc/qgemm.cpp, csrc/quant.cpp). The wrappers allocate the outputs and pass the
tensors (large outputs reused: backends/cpu/buffers.py; a caller's checked out= buffer written
instead when given); the kernels read their layouts (copying what they cannot read in place)
and validate the counts of the grouped forms themselves."""
from __future__ import annotations

import torch

from . import cpu
from .buffers import empty, empty_like
from .native import _C, FLOATS, FP8, threads

_I8 = torch.int8


@cpu.impl("fp8_block_gemm", dtypes=(FP8,))
def fp8_block_gemm(a, a_scale, w, w_scale, out_dtype=torch.bfloat16, *, out=None):
    if out is None:
        out = empty((a.shape[0], w.shape[0]), out_dtype)
    _C.fp8_block_gemm(out, a, a_scale, w, w_scale, threads())
    return out


# validates_values: the kernel checks tokens_per_expert itself, before writing (csrc/qgemm.cpp).
@cpu.impl("fp8_grouped_gemm", dtypes=(FP8,), validates_values=True)
def fp8_grouped_gemm(a, a_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16, *, out=None):
    if out is None:
        out = empty((a.shape[0], w.shape[1]), out_dtype)
    _C.fp8_grouped_gemm(out, a, a_scale, w, w_scale, tokens_per_expert, threads())
    return out


@cpu.impl("int8_quant", dtypes=FLOATS)
def int8_quant(x):
    q = empty_like(x, _I8)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32)
    _C.int8_quant(q, scale, x, threads())
    return q, scale


@cpu.impl("int8_gemm", dtypes=(_I8,))
def int8_gemm(x, x_scale, w, w_scale, out_dtype=torch.bfloat16, bias=None, *, out=None):
    if out is None:
        out = empty((x.shape[0], w.shape[0]), out_dtype)
    _C.int8_gemm(out, x, x_scale, w, w_scale, bias, threads())
    return out


@cpu.impl("int8_grouped_gemm", dtypes=(_I8,), validates_values=True)
def int8_grouped_gemm(x, x_scale, w, w_scale, tokens_per_expert, out_dtype=torch.bfloat16, *, out=None):
    if out is None:
        out = empty((x.shape[0], w.shape[1]), out_dtype)
    _C.int8_grouped_gemm(out, x, x_scale, w, w_scale, tokens_per_expert, threads())
    return out
