"""Reference implementations of the quantization ops (OPS.md section 3).

Quantization math runs in float32 whatever the input dtype (the formats are defined
on float32 scales); results are compared after dequantization.
"""
from __future__ import annotations

import torch

__all__ = ["fp8_block_quant", "int4_fake_quant", "int4_pack", "int4_unpack", "w4a16_gemm"]

FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4
INT4_QMAX = 7
INT4_MIN_SCALE = 1e-5
INT4_PER_INT32 = 8


def fp8_block_quant(x: torch.Tensor, block: int = 128, scale_fmt: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = xf.abs().amax(dim=-1).clamp_min(FP8_MIN_AMAX)
    scale = amax / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def int4_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The symmetric INT4 grid of `w [N, K]`: int32 `q [N, K]` in [-7, 7] and the float32
    per-group scales `[N, K / group_size]`."""
    n, k = w.shape
    wf = w.float().reshape(n, k // group_size, group_size)
    scale = (wf.abs().amax(dim=-1) / INT4_QMAX).clamp_min(INT4_MIN_SCALE)
    q = torch.round(wf / scale.unsqueeze(-1)).clamp(-INT4_QMAX, INT4_QMAX)
    # Through int32 so that a rounded -0.0 becomes +0.0: fake-quant and pack -> unpack then
    # agree bit for bit, signed zeros included.
    return q.to(torch.int32).reshape(n, k), scale


def int4_dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """`q [N, K]` (an integer tensor) times its group's scale, in float32."""
    n, k = q.shape
    grouped = q.float().reshape(n, k // group_size, group_size) * scale.float().unsqueeze(-1)
    return grouped.reshape(n, k)


def int4_fake_quant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    q, scale = int4_quantize(w, group_size)
    return int4_dequantize(q, scale, group_size).to(w.dtype)


def _nibble_shifts(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(0, 32, 4, device=device, dtype=dtype)  # element 8j + i -> bits 4i..4i+3


def int4_pack(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = int4_quantize(w, group_size)
    n, k = q.shape
    nibbles = (q.to(torch.int64) + 8).reshape(n, k // INT4_PER_INT32, INT4_PER_INT32)
    # Build the word in int64 (no signed overflow), then wrap bit 31 into the int32 sign
    # explicitly: an int64 -> int32 cast that truncates is not something every device promises.
    words = (nibbles << _nibble_shifts(w.device, torch.int64)).sum(dim=-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32), scale


def int4_unpack(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    n, words = packed.shape
    # An arithmetic right shift of a negative word copies the sign bit into the high bits,
    # but `& 0xF` keeps only the nibble, so int32 arithmetic suffices.
    nibbles = (packed.unsqueeze(-1) >> _nibble_shifts(packed.device, packed.dtype)) & 0xF
    q = (nibbles - 8).reshape(n, words * INT4_PER_INT32)
    return int4_dequantize(q, scale, group_size)


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int
               ) -> torch.Tensor:
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    weight = int4_unpack(packed, scale, group_size).to(ct)
    return (x.to(ct) @ weight.T).to(x.dtype)
