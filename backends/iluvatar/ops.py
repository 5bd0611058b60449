"""Adapters from glm5_hal's canonical ops to what an Iluvatar CoreX machine offers: ixformer
(Iluvatar's closed op library), FlagGems' Iluvatar kernels, torch's own CoreX kernels and the
backend's own kernels (the shared CUDA-dialect sources built by CoreX's clang++).

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
IluvatarBackend instance binds to itself; it reaches the vendor through `backend.runtime`
(IluvatarRuntime over the real modules, or the emulator in tests). Inputs arrive validated by
glm5_hal.ops; an adapter converts layouts and index conventions, calls the vendor function
and returns exactly the canonical outputs. Each adapter's predicate returns a reason when the call
is outside what the vendor function takes (dtype, a missing package, an unverified version,
kernels not built), so dispatch moves on. No adapter reads device data on the host.

Declined by design, with the source: FlagGems' Iluvatar sparse attention
(`_iluvatar/fused/sparse_attention.py` sparse_attn_triton @ed2508bc) returns no log-sum-exp and
clamps an index of -1 to row 0 without masking it (`safe_idxs = tl.maximum(idxs, 0)`; only slots
past topk are masked), so it cannot serve sparse_mla_attention's contract; the CoreX kernel does.
README.md has the table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from glm5_hal.backends._cuda_dialect import adapters as gpu
from glm5_hal.backends._cuda_dialect import per_row_topk
from glm5_hal.vendor_backend import Adapter, Verdict, dtype_name, first_reason
from glm5_hal.vendor_ops.dsa import SPARSE_MLA_DECODE_PAGED
from glm5_hal.vendor_ops.quant import reciprocal_overflow

from . import chips

if TYPE_CHECKING:
    from . import IluvatarBackend

_F32, _F16, _BF16, _I8 = torch.float32, torch.float16, torch.bfloat16, torch.int8
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "ixformer rms_norm": "fp16/bf16 (what its public callers pass), weight in x's dtype",
    "ixformer dynamic_scaled_int8_quant": "fp16/bf16 activations; rows of zeros fixed to the contract's 0 codes; rows "
                                          "whose 127 / absmax overflows declined (checked where x is host-readable)",
    "ixformer w8a8": "fp16/bf16 out, no float32 bias (it takes the model dtype's); ixformer 0.7.x call form",
    "flag_gems top_k_per_row_prefill": "float32 logits; rows no longer than its candidate buffer "
                                       f"(next_pow2(max(2 * topk, {chips.TOPK_MIN_CANDIDATES}))); tail slots sanitised",
    "flag_gems sparse_attn_triton": "not used: no lse, index -1 read as row 0",
    "flag_gems silu_and_mul": "f32/f16/bf16 (FlagGems' fused Triton kernel) when the CoreX kernel is not built",
    **gpu.KERNEL_LIMITS,
}


def _ixformer_declined(backend: "IluvatarBackend") -> str | None:
    runtime = backend.runtime
    return runtime.ixformer_missing if runtime.ixformer is None else None


# -- ixformer: rms_norm, int8_quant, int8_gemm ------------------------------------------------------
def rms_norm_supported(backend: "IluvatarBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return first_reason(
        lambda: _ixformer_declined(backend),
        lambda: None if weight.dtype == x.dtype else
        f"ixformer's rms_norm takes the weight in x's dtype; casting the {dtype_name(weight.dtype)} weight to "
        f"{dtype_name(x.dtype)} would round it")


def rms_norm(backend: "IluvatarBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return backend.runtime.ixformer.rms_norm(rows, weight.contiguous(), float(eps)).view(x.shape)


def int8_quant_supported(backend: "IluvatarBackend", x: Tensor) -> Verdict:
    return first_reason(lambda: _ixformer_declined(backend),
                        lambda: reciprocal_overflow(x, "ixformer's dynamic_scaled_int8_quant"))


def int8_quant(backend: "IluvatarBackend", x: Tensor) -> tuple[Tensor, Tensor]:
    codes = torch.empty(x.shape, dtype=_I8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=_F32, device=x.device)
    if x.numel() == 0:
        return codes, scale
    backend.runtime.ixformer.dynamic_scaled_int8_quant(output=codes, input=x.contiguous(), scale=scale)
    # a row of zeros divides by a zero scale (unspecified codes); the contract gives it 0 codes
    return torch.where((scale == 0).unsqueeze(-1), 0, codes).to(_I8), scale


def int8_gemm_supported(backend: "IluvatarBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                        out_dtype: torch.dtype, bias: Tensor | None) -> Verdict:
    return first_reason(
        lambda: _ixformer_declined(backend),
        lambda: backend.unverified("ixformer_w8a8"),
        lambda: None if out_dtype in HALVES else
        f"ixformer's w8a8 writes fp16/bf16 outputs (its callers' model dtype), not {dtype_name(out_dtype)}",
        lambda: None if bias is None else
        "ixformer's w8a8 takes its bias in the output dtype: the float32 bias would round before it is added")


def int8_gemm(backend: "IluvatarBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
              out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.shape[1] == 0:
        return out.zero_()
    backend.runtime.ixformer.w8a8(x.contiguous(), w.contiguous(), x_scale.contiguous(), w_scale.contiguous(),
                                  None, out)
    return out


# -- silu_and_mul: CoreX kernel, else FlagGems' fused kernel ----------------------------------------
def _silu_route(backend: "IluvatarBackend") -> tuple[str | None, str]:
    kernel = backend.kernels.missing()
    if kernel is None:
        return "kernel", ""
    runtime = backend.runtime
    gems = (runtime.flag_gems_silu_missing if runtime.silu_and_mul is None else None) or \
        backend.unverified("flag_gems_silu_and_mul")
    return ("flag_gems", "") if gems is None else (None, f"{kernel}; {gems}")


def silu_and_mul_supported(backend: "IluvatarBackend", x: Tensor) -> Verdict:
    path, reason = _silu_route(backend)
    return True if path else reason


def silu_and_mul(backend: "IluvatarBackend", x: Tensor) -> Tensor:
    path, _ = _silu_route(backend)
    if path == "kernel":
        return gpu.silu_and_mul(backend, x)
    half = x.shape[-1] // 2
    if x.numel() == 0:
        return x.new_empty((*x.shape[:-1], half))
    return backend.runtime.silu_and_mul(x[..., :half], x[..., half:])


# -- indexer: CoreX kernel, else torch logits + FlagGems' per-row top-k ------------------------------
def _gems_declined(backend: "IluvatarBackend", span: int, topk: int) -> str | None:
    runtime = backend.runtime
    if runtime.top_k_per_row_prefill is None:
        return runtime.flag_gems_missing
    slots = chips.topk_candidate_slots(topk)
    if span > slots:
        return (f"FlagGems' top_k_per_row_prefill writes a row's candidates into {slots} slots without a bound: rows "
                f"of {span} keys could overflow it")
    return backend.unverified("flag_gems_topk")


def _indexer_route(backend: "IluvatarBackend", q: Tensor, span: int, topk: int) -> tuple[str | None, str]:
    kernel = backend.kernels.missing() or gpu.indexer_shape_declined(q)
    if kernel is None:
        return "kernel", ""
    gems = _gems_declined(backend, span, topk)
    if gems is None:
        return "flag_gems", ""
    return None, f"{kernel}; {gems}"


def _key_rows(k: Any) -> int:
    return (k[0] if isinstance(k, (tuple, list)) else k).shape[0]


def _paged_span(k_cache: Any, block_table: Tensor) -> int:
    cache = k_cache[0] if isinstance(k_cache, (tuple, list)) else k_cache
    return block_table.shape[1] * cache.shape[1]


def indexer_topk_supported(backend: "IluvatarBackend", q: Tensor, k: Any, weights: Tensor, k_start: Tensor,
                           k_end: Tensor, topk: int) -> Verdict:
    path, reason = _indexer_route(backend, q, _key_rows(k), topk)
    return True if path else reason


def indexer_topk(backend: "IluvatarBackend", q: Tensor, k: Any, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    path, _ = _indexer_route(backend, q, _key_rows(k), topk)
    if path == "kernel":
        return gpu.indexer_topk(backend, q, k, weights, k_start, k_end, topk)
    # FlagGems' kernel leaves index 0 (its zeroed candidate buffer) in the slots past a short
    # row, where the contract has -1: per_row_topk keeps only the slots inside each row
    return per_row_topk.indexer_topk(backend.runtime.top_k_per_row_prefill, q, k, weights, k_start, k_end, topk)


def indexer_topk_paged_supported(backend: "IluvatarBackend", q: Tensor, k_cache: Any, weights: Tensor,
                                 block_table: Tensor, context_lens: Tensor, topk: int) -> Verdict:
    path, reason = _indexer_route(backend, q, _paged_span(k_cache, block_table), topk)
    return True if path else reason


def indexer_topk_paged(backend: "IluvatarBackend", q: Tensor, k_cache: Any, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    path, _ = _indexer_route(backend, q, _paged_span(k_cache, block_table), topk)
    if path == "kernel":
        return gpu.indexer_topk_paged(backend, q, k_cache, weights, block_table, context_lens, topk)
    return per_row_topk.indexer_topk_paged(backend.runtime.top_k_per_row_prefill, q, k_cache, weights, block_table,
                                           context_lens, topk)


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=HALVES, supports_metadata=rms_norm_supported),
    # per call: the 127 / absmax overflow is a data check
    Adapter("int8_quant", int8_quant, dtypes=HALVES, supports=int8_quant_supported),
    Adapter("int8_gemm", int8_gemm, dtypes=(_I8,), supports_metadata=int8_gemm_supported),
    Adapter("indexer_topk", indexer_topk, dtypes=FLOATS, supports_metadata=indexer_topk_supported),
    Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=FLOATS, supports_metadata=indexer_topk_paged_supported),
    # the CoreX kernels (shared CUDA-dialect sources)
    Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS, supports_metadata=silu_and_mul_supported),
    gpu.SPARSE_MLA_ATTENTION, SPARSE_MLA_DECODE_PAGED,
    gpu.KV_CACHE_WRITE, gpu.MOE_PERMUTE, gpu.MOE_UNPERMUTE,
)
