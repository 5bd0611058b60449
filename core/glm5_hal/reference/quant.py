"""Reference implementations of the quantization ops (OPS.md section 3).

Quantization math runs in float32 whatever the input dtype (the formats are defined
on float32 scales); results are compared after dequantization.
"""
from __future__ import annotations

import torch

__all__ = ["fp8_block_quant"]

FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4


def fp8_block_quant(x: torch.Tensor, block: int = 128, scale_fmt: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = xf.abs().amax(dim=-1).clamp_min(FP8_MIN_AMAX)
    scale = amax / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale
