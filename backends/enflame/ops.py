"""Adapters from glm5_hal's canonical ops to the kernels vllm-gcu registers for Enflame GCUs
(`torch.ops._C.*`, `torch.ops._C_cache_ops.*` once `vllm_gcu._C` is imported).

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
EnflameBackend instance binds to itself; it reaches the vendor through `backend.runtime`
(GcuRuntime over the real modules, or the emulator in tests). Inputs arrive validated by
glm5_hal.ops; an adapter converts layouts, calls the vendor op and returns exactly the
canonical outputs. Each adapter's predicate returns a reason when the call is outside what the
vendor op takes (dtype, vllm-gcu missing, a vllm-gcu version outside the one read), so
dispatch moves on. No adapter reads device data on the host. README.md has the table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from glm5_hal.vendor_backend import Adapter, Verdict, dtype_name, first_reason
from glm5_hal.vendor_ops.common import rope_by_rotary_embedding, weight_cast_declined
from glm5_hal.vendor_ops.moe import sigmoid_underflow
from glm5_hal.vendor_ops.quant import reciprocal_overflow

if TYPE_CHECKING:
    from . import EnflameBackend

_F32, _F16, _BF16, _I64 = torch.float32, torch.float16, torch.bfloat16, torch.int64
FLOATS = (_F32, _F16, _BF16)

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "_C.rms_norm / _C.silu_and_mul": "float32/float16/bfloat16 (vLLM's schema; the weight in x's dtype)",
    "_C.rotary_embedding": "in place on a float32 copy with a float32 cos_sin_cache; both pair layouts",
    "_C.dynamic_scaled_int8_quant": "symmetric per token (azp None); rows of zeros fixed to the contract's 0 codes; "
                                    "rows whose 127 / absmax overflows declined (checked where x is host-readable)",
    "_C_cache_ops.concat_and_cache_mla": "kv_cache_dtype 'auto' (cache dtype = values dtype), int64 slots, D >= 2, "
                                         "contiguous cache (no block-strided page views)",
    "_C.linear_quant": "fp8_block_gemm on gcu400 (FP8 from vLLM capability 14.0): fp16/bf16 out (vLLM's "
                       "w8a8_block_fp8_matmul layout: per-token-group x 128 x 128 block scales)",
    "_C.fused_grouped_topk": "moe_route with float32 logits and bias (vLLM 0.9's grouped_topk scores in the "
                             "logits' dtype); groups of >= 2 experts (its topk(2)); sigmoid scores that underflow "
                             "declined where the logits are host-readable (it renormalises by a plain sum)",
    "vllm_gcu versions": "op schemas read for vllm-gcu on vLLM 0.8.0-0.9.2 (chips.VLLM_GCU_OPS); others declined",
}


def _ops_declined(backend: "EnflameBackend") -> str | None:
    runtime = backend.runtime
    if runtime.ops is None:
        return runtime.ops_missing
    return backend.unverified("vllm_gcu_ops")


# -- rms_norm, silu_and_mul -------------------------------------------------------------------------
def rms_norm_supported(backend: "EnflameBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return first_reason(lambda: _ops_declined(backend),
                        lambda: weight_cast_declined(x, weight, "vLLM's rms_norm schema takes the weight"))


def rms_norm(backend: "EnflameBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    backend.runtime.ops._C.rms_norm(out, x.contiguous(), weight.to(x.dtype).contiguous(), float(eps))
    return out


def silu_and_mul_supported(backend: "EnflameBackend", x: Tensor) -> Verdict:
    return _ops_declined(backend) or True


def silu_and_mul(backend: "EnflameBackend", x: Tensor) -> Tensor:
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    if out.numel() == 0:
        return out
    backend.runtime.ops._C.silu_and_mul(out, x.contiguous())
    return out


# -- apply_rope -----------------------------------------------------------------------------------
def apply_rope_supported(backend: "EnflameBackend", x: Tensor, positions: Tensor, theta: float,
                         interleaved: bool) -> Verdict:
    return _ops_declined(backend) or True


def apply_rope(backend: "EnflameBackend", x: Tensor, positions: Tensor, theta: float, interleaved: bool) -> Tensor:
    return rope_by_rotary_embedding(backend.runtime.ops._C.rotary_embedding, x, positions, theta, interleaved)


# -- int8_quant ---------------------------------------------------------------------------------------
def int8_quant_supported(backend: "EnflameBackend", x: Tensor) -> Verdict:
    return first_reason(lambda: _ops_declined(backend),
                        lambda: reciprocal_overflow(x, "_C.dynamic_scaled_int8_quant"))


def int8_quant(backend: "EnflameBackend", x: Tensor) -> tuple[Tensor, Tensor]:
    rows = x.reshape(-1, x.shape[-1]).contiguous() if x.numel() else x.reshape(-1, x.shape[-1])
    codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty((rows.shape[0], 1), dtype=_F32, device=x.device)
    if x.numel() == 0:
        return codes, scales.view(x.shape[:-1])
    backend.runtime.ops._C.dynamic_scaled_int8_quant(codes.view(rows.shape), rows, scales, None)
    scale = scales.view(x.shape[:-1])
    # a row of zeros divides by a zero scale in vLLM's kernel; the contract gives it 0 codes
    return torch.where((scale == 0).unsqueeze(-1), 0, codes).to(torch.int8), scale


# -- kv_cache_write ---------------------------------------------------------------------------------
def kv_cache_write_supported(backend: "EnflameBackend", cache: Tensor, values: Tensor,
                             slot_mapping: Tensor) -> Verdict:
    # the contract gives a [blocks, block_size, D] cache of the values' dtype, which is what
    # kv_cache_dtype "auto" stores; it may be a block-strided page view (paged caches), which
    # vLLM's kernel of this schema honours (block and entry strides) but whether topsvllm's does
    # is not public
    return first_reason(
        lambda: _ops_declined(backend),
        lambda: None if cache.shape[-1] >= 2 else "concat_and_cache_mla splits a row into kv_c and k_pe: D >= 2",
        lambda: None if cache.is_contiguous() else
        "concat_and_cache_mla is called with contiguous caches by vllm-gcu; whether topsvllm honours a block-strided "
        "page view is not public")


def kv_cache_write(backend: "EnflameBackend", cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    tokens, dim = values.shape
    if tokens == 0:
        return
    # the MLA row is kv_c then k_pe; the contract's row is written whole, so any split holds
    split = dim - dim // 2
    values = values.contiguous()
    scale = torch.ones(1, dtype=_F32, device=values.device)
    backend.runtime.ops._C_cache_ops.concat_and_cache_mla(values[:, :split], values[:, split:], cache,
                                                          slot_mapping.to(_I64).contiguous(), "auto", scale)


# -- moe_route ---------------------------------------------------------------------------------------
def moe_route_supported(backend: "EnflameBackend", logits: Tensor, bias: Tensor | None, top_k: int, n_group: int,
                        topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool,
                        score_func: str) -> Verdict:
    per_group = logits.shape[1] // n_group
    return first_reason(
        lambda: _ops_declined(backend),
        lambda: None if per_group >= 2 else
        f"vLLM's grouped_topk scores a group by its best two experts (topk(2)): groups of {per_group} expert are "
        "not handled",
        lambda: sigmoid_underflow(logits, "fused_grouped_topk")
        if norm_topk_prob and score_func == "sigmoid" else None)


def moe_route(backend: "EnflameBackend", logits: Tensor, bias: Tensor | None, top_k: int, n_group: int,
              topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool,
              score_func: str) -> tuple[Tensor, Tensor]:
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=_F32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    # float32 in: vLLM 0.9's grouped_topk (whose call vllm-gcu's op replaces) scores in the logits'
    # dtype, and a bf16 router would round the weights; the schema's bias is not optional, and a
    # zero bias is the contract's no-bias routing (a group's best two scores, unbiased weights)
    correction = bias.to(_F32).contiguous() if bias is not None else torch.zeros(experts, dtype=_F32,
                                                                                  device=logits.device)
    backend.runtime.ops._C.fused_grouped_topk(weights, ids, logits.to(_F32).contiguous(), top_k, norm_topk_prob,
                                              n_group, topk_group, correction, score_func)
    if routed_scaling_factor != 1.0:   # vLLM applies it outside grouped_topk
        weights.mul_(routed_scaling_factor)
    return weights, ids


# -- fp8_block_gemm ---------------------------------------------------------------------------------
def fp8_block_gemm_supported(backend: "EnflameBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                             out_dtype: torch.dtype) -> Verdict:
    # a gcu300 never gets here: its capabilities declare no FP8 (chips.GENERATIONS, vllm-gcu's
    # supports_fp8() from capability 14.0), so dispatch declines it first
    return first_reason(
        lambda: _ops_declined(backend),
        lambda: None if out_dtype in (_F16, _BF16) else
        f"linear_quant serves w8a8_block_fp8_matmul, whose outputs are fp16/bf16, not {dtype_name(out_dtype)}")


def fp8_block_gemm(backend: "EnflameBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                   out_dtype: torch.dtype) -> Tensor:
    out = torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:   # linear_quant returns at once on an empty lhs, leaving out unwritten
        return out.zero_()
    # vllm-gcu's w8a8_block_fp8_matmul: linear_quant(C, A, B, bias, As, Bs) (_custom_ops.py:564-579)
    backend.runtime.ops._C.linear_quant(out, a.contiguous(), w.contiguous(), None, a_scale.contiguous(),
                                        w_scale.contiguous())
    return out


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS, supports_metadata=rms_norm_supported),
    Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS, supports_metadata=silu_and_mul_supported),
    Adapter("apply_rope", apply_rope, dtypes=FLOATS, supports_metadata=apply_rope_supported),
    # per call: the 127 / absmax overflow is a data check
    Adapter("int8_quant", int8_quant, dtypes=FLOATS, supports=int8_quant_supported),
    # per call: reads the cache's contiguity (the call key holds only whether it is paged)
    Adapter("kv_cache_write", kv_cache_write, supports=kv_cache_write_supported),
    # per call: sigmoid underflow is a data check on the logits
    Adapter("moe_route", moe_route, dtypes=FLOATS, supports=moe_route_supported),
    Adapter("fp8_block_gemm", fp8_block_gemm, dtypes=(torch.float8_e4m3fn,),
            supports_metadata=fp8_block_gemm_supported),
)
