"""Quantization ops on the cpu backend (OPS.md section 3). fp8_block_quant is native
(csrc/quant.cpp); the INT4 ops call torch (see each for why)."""
from __future__ import annotations

import torch

from glm5_hal.reference import quant as ref

from . import cpu
from .ops import _C, DTYPE_CODE, FLOATS, _threads, rows_view

_FP8 = torch.float8_e4m3fn
_UE8M0 = "ue8m0"


@cpu.impl("fp8_block_quant", dtypes=FLOATS)
def fp8_block_quant(x, block=128, scale_fmt=None):
    x2 = rows_view(x)
    rows, cols = x2.shape
    q = torch.empty((rows, cols), dtype=_FP8)
    scale = torch.empty((rows, cols // block), dtype=torch.float32)
    _C.fp8_block_quant(q.data_ptr(), scale.data_ptr(), x2.data_ptr(), rows, cols, x2.stride(0), block,
                       scale_fmt == _UE8M0, DTYPE_CODE[x.dtype], _threads())
    return q.view(x.shape), scale.view(*x.shape[:-1], cols // block)


# The INT4 ops run once per weight (packing, QAT fake-quant) or are dominated by the GEMM:
# torch's vectorised elementwise kernels are what a native loop would be, so these call torch.
@cpu.impl("int4_fake_quant", dtypes=FLOATS)
def int4_fake_quant(w, group_size):
    return ref.int4_fake_quant(w, group_size)


@cpu.impl("int4_pack", dtypes=FLOATS)
def int4_pack(w, group_size):
    return ref.int4_pack(w, group_size)


@cpu.impl("int4_unpack", dtypes=(torch.int32,))
def int4_unpack(packed, scale, group_size):
    return ref.int4_unpack(packed, scale, group_size)


@cpu.impl("w4a16_gemm", dtypes=FLOATS)
def w4a16_gemm(x, packed, scale, group_size):
    # Dequantize the weight once, then one torch GEMM in float32 (the fp32 accumulation the
    # contract asks for; a bf16 copy of the weight would round every weight once more).
    weight = ref.int4_unpack(packed, scale, group_size)
    return torch.mm(x.float(), weight.t()).to(x.dtype)
