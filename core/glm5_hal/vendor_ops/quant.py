"""Vendor adapter helpers of the quantization ops (docs/ops/quant.md)."""
from __future__ import annotations

import torch

from ..vendor_backend import host_reads_allowed

#: vLLM's dynamic int8 quant multiplies by 127 / absmax (`tmp_scale = 127.0f / block_absmax_val` in
#: dynamic_scaled_int8_quant_kernel, vllm-project/vllm csrc/quantization/compressed_tensors/
#: int8_quant_kernels.cu @00b0571e), which overflows to inf for a row whose absmax is below
#: 127 / FLT_MAX: every code of it would saturate.
SCALE_OVERFLOW_ABSMAX = 127.0 / torch.finfo(torch.float32).max


def reciprocal_overflow(x: torch.Tensor, kernel: str) -> str | None:
    """The reason to decline a quantization whose 127 / absmax overflows (a nonzero row below
    SCALE_OVERFLOW_ABSMAX). A data check: on a device it runs only under GLM5_HAL_CHECKS=full
    (reading x would synchronise), so there such rows reach the kernel unseen by default."""
    if not x.numel() or not host_reads_allowed(x):
        return None
    absmax = x.detach().float().abs().amax(-1)
    if bool(((absmax > 0) & (absmax < SCALE_OVERFLOW_ABSMAX)).any()):
        return (f"a row's absmax is below {SCALE_OVERFLOW_ABSMAX:.3g}: {kernel} multiplies by 127 / absmax (vLLM's "
                "formula), which overflows to inf and saturates every code")
    return None
