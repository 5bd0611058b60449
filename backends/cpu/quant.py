"""Quantization ops on the cpu backend (OPS.md section 3), native (csrc/quant.cpp); w4a16_gemm
dequantizes natively and multiplies with torch."""
from __future__ import annotations

import torch

from . import cpu
from .native import _C, DTYPE_CODE, FLOATS, FP8, rows_view, threads

_UE8M0 = "ue8m0"


@cpu.impl("fp8_block_quant", dtypes=FLOATS)
def fp8_block_quant(x, block=128, scale_fmt=None):
    x2 = rows_view(x)
    rows, cols = x2.shape
    q = torch.empty((rows, cols), dtype=FP8)
    scale = torch.empty((rows, cols // block), dtype=torch.float32)
    _C.fp8_block_quant(q.data_ptr(), scale.data_ptr(), x2.data_ptr(), rows, cols, x2.stride(0), block,
                       scale_fmt == _UE8M0, DTYPE_CODE[x.dtype], threads())
    return q.view(x.shape), scale.view(*x.shape[:-1], cols // block)


@cpu.impl("int4_fake_quant", dtypes=FLOATS)
def int4_fake_quant(w, group_size):
    if w.shape[1] > 1 and w.stride(1) != 1:
        w = w.contiguous()
    out = torch.empty(w.shape, dtype=w.dtype)
    _C.int4_quantize(out.data_ptr(), 0, 0, w.data_ptr(), w.shape[0], w.shape[1], w.stride(0), group_size,
                     DTYPE_CODE[w.dtype], threads())
    return out


@cpu.impl("int4_pack", dtypes=FLOATS)
def int4_pack(w, group_size):
    if w.shape[1] > 1 and w.stride(1) != 1:
        w = w.contiguous()
    n, k = w.shape
    packed = torch.empty((n, k // 8), dtype=torch.int32)
    scale = torch.empty((n, k // group_size), dtype=torch.float32)
    _C.int4_quantize(0, packed.data_ptr(), scale.data_ptr(), w.data_ptr(), n, k, w.stride(0), group_size,
                     DTYPE_CODE[w.dtype], threads())
    return packed, scale


def _unpack(packed, scale, group_size):
    if packed.shape[1] > 1 and packed.stride(1) != 1:
        packed = packed.contiguous()
    if not scale.is_contiguous():
        scale = scale.contiguous()
    n, words = packed.shape
    out = torch.empty((n, 8 * words), dtype=torch.float32)
    _C.int4_unpack(out.data_ptr(), packed.data_ptr(), scale.data_ptr(), n, words, packed.stride(0), group_size,
                   threads())
    return out


@cpu.impl("int4_unpack", dtypes=(torch.int32,))
def int4_unpack(packed, scale, group_size):
    return _unpack(packed, scale, group_size)


@cpu.impl("w4a16_gemm", dtypes=FLOATS)
def w4a16_gemm(x, packed, scale, group_size):
    # Dequantize the weight natively, then one torch GEMM (oneDNN/BLAS: the best CPU GEMM at
    # hand) in float32, the accumulation the contract asks for; a bf16 copy of the weight
    # would round every weight once more.
    return torch.mm(x.float(), _unpack(packed, scale, group_size).t()).to(x.dtype)
