"""Quantization ops on the cpu backend (docs/ops/quant.md), native (csrc/quant.cpp); w4a16_gemm
dequantizes natively and multiplies with torch."""
from __future__ import annotations

import torch

from . import cpu
from .buffers import empty, empty_like
from .native import _C, FLOATS, FP8, threads

_UE8M0 = "ue8m0"


@cpu.impl("fp8_block_quant", dtypes=FLOATS)
def fp8_block_quant(x, block=128, scale_fmt=None):
    q = empty_like(x, FP8)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.float32)
    _C.fp8_block_quant(q, scale, x, block, scale_fmt == _UE8M0, threads())
    return q, scale


@cpu.impl("int4_fake_quant", dtypes=FLOATS)
def int4_fake_quant(w, group_size):
    out = empty_like(w)
    _C.int4_quantize(out, None, None, w, group_size, threads())
    return out


@cpu.impl("int4_pack", dtypes=FLOATS)
def int4_pack(w, group_size):
    n, k = w.shape
    packed = empty((n, k // 8), torch.int32)
    scale = torch.empty((n, k // group_size), dtype=torch.float32)
    _C.int4_quantize(None, packed, scale, w, group_size, threads())
    return packed, scale


def _unpack(packed, scale, group_size):
    out = empty((packed.shape[0], 8 * packed.shape[1]), torch.float32)
    _C.int4_unpack(out, packed, scale, group_size, threads())
    return out


@cpu.impl("int4_unpack", dtypes=(torch.int32,))
def int4_unpack(packed, scale, group_size):
    return _unpack(packed, scale, group_size)


@cpu.impl("w4a16_gemm", dtypes=FLOATS)
def w4a16_gemm(x, packed, scale, group_size, *, out=None):
    # Dequantize the weight natively, then one torch GEMM (oneDNN/BLAS: the best CPU GEMM at
    # hand) in float32, the accumulation the contract asks for; a bf16 copy of the weight
    # would round every weight once more.
    # The float32 product and the weight land in cached buffers: both are as large as outputs.
    # A float32 out= buffer takes the product itself; another dtype takes the rounded copy.
    if out is not None and x.dtype == torch.float32:
        return torch.mm(x, _unpack(packed, scale, group_size).t(), out=out)
    acc = empty((x.shape[0], packed.shape[0]), torch.float32)
    torch.mm(x.float(), _unpack(packed, scale, group_size).t(), out=acc)
    if x.dtype == torch.float32:
        return acc
    return (empty(acc.shape, x.dtype) if out is None else out).copy_(acc)
