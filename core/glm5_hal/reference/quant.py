"""Reference implementations of the quantization ops (docs/ops/quant.md) and the GEMMs on
the checkpoint formats (section 3.1).

Quantization math runs in float32 whatever the input dtype (the formats are defined on
float32 scales); results are compared after dequantization. The GEMMs dequantize and
accumulate in float32, or float64 when the scales are float64 (the conformance suite upcasts
them); INT8 products are summed exactly.
"""
from __future__ import annotations

import torch

__all__ = ["fp8_block_quant", "int4_fake_quant", "int4_pack", "int4_unpack", "w4a16_gemm",
           "fp8_block_gemm", "fp8_grouped_gemm", "int8_quant", "int8_gemm", "int8_grouped_gemm"]

FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4
INT4_QMAX = 7
INT4_MIN_SCALE = 1e-5
INT4_PER_INT32 = 8
FP8_GEMM_BLOCK = 128   # DeepSeek-V3 / GLM-5 FP8 checkpoints: 128 x 128 weight blocks, 1 x 128 activation blocks
INT8_QMAX = 127


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


def _compute_dtype(scale: torch.Tensor) -> torch.dtype:
    return torch.float64 if scale.dtype == torch.float64 else torch.float32


def _scaled_blocks(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values [R, C] (a fresh tensor, scaled in place) times one scale per block of 128 columns,
    scale [R, ceil(C/128)]: a view per whole block, so nothing of the size of values is
    allocated again (the reference must stay affordable at GLM-5's shapes)."""
    b = FP8_GEMM_BLOCK
    rows, cols = values.shape
    whole = cols // b
    values[:, : whole * b].view(rows, whole, b).mul_(scale[:, :whole, None])
    if whole * b < cols:
        values[:, whole * b:].mul_(scale[:, whole:])
    return values


def fp8_block_dequantize(w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 weight [N, K] with its 128 x 128 block scales [ceil(N/128), ceil(K/128)] (which
    multiply, despite the checkpoints' name `weight_scale_inv`) in `dtype`."""
    row_scales = w_scale.to(dtype).repeat_interleave(FP8_GEMM_BLOCK, dim=0)[: w.shape[0]]
    return _scaled_blocks(w.to(dtype), row_scales)


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    ct = _compute_dtype(a_scale)
    a_deq = _scaled_blocks(a.to(ct), a_scale.to(ct))
    return (a_deq @ fp8_block_dequantize(w, w_scale, ct).T).to(out_dtype)


def _per_expert(gemm, x, x_scale, w, w_scale, tokens_per_expert, out_dtype) -> torch.Tensor:
    """`gemm` over each expert's contiguous rows; experts without rows cost nothing (their
    weight is never dequantized)."""
    counts = tokens_per_expert.tolist()
    empty = torch.empty(0, w.shape[1], dtype=out_dtype, device=x.device)
    outs = [gemm(rows, scales, w[e], w_scale[e], out_dtype) if n else empty
            for e, (n, rows, scales) in enumerate(zip(counts, x.split(counts), x_scale.split(counts)))]
    return torch.cat(outs) if outs else empty


def fp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return _per_expert(fp8_block_gemm, a, a_scale, w, w_scale, tokens_per_expert, out_dtype)


def int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_QMAX
    # a zero row gets scale 0 and codes 0 (dividing by 1 instead of 0 keeps them 0)
    q = torch.round(xf / torch.where(scale == 0, 1.0, scale).unsqueeze(-1)).clamp(-INT8_QMAX, INT8_QMAX)
    return q.to(torch.int8), scale


def int8_gemm(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    ct = _compute_dtype(x_scale)
    # float64 holds every int8 dot product exactly (|sum| <= K * 127^2 < 2^53); the contract's
    # int32 accumulator is then rounded once to the compute dtype and scaled
    acc = (x.to(torch.float64) @ w.to(torch.float64).T).to(ct)
    out = acc * x_scale.to(ct)[:, None] * w_scale.to(ct)[None, :]
    if bias is not None:
        out = out + bias.to(ct)
    return out.to(out_dtype)


def int8_grouped_gemm(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return _per_expert(int8_gemm, x, x_scale, w, w_scale, tokens_per_expert, out_dtype)
