"""Adapters from glm5_hal's canonical ops to what torch_musa, MooreThreads' mate and the
backend's own kernels offer.

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
MusaBackend instance binds to itself; it reaches the vendor through `backend.runtime`
(MusaRuntime over the real modules, or the emulator in tests), so several instances coexist.
Inputs arrive validated by glm5_hal.ops; an adapter converts layouts and index conventions,
calls the vendor function and returns exactly the canonical outputs. Each adapter's predicate
checks the vendor's per-call constraints (chip generation, dtype, shapes, muDNN version,
whether mate / the kernels exist, whether the installed vendor version is one the behaviour
was read from: arch.BEHAVIOURS) and returns a reason when the call falls outside them, so
dispatch moves on. No adapter reads device data on the host. README.md has the table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from glm5_hal.backends._cuda_dialect import adapters as gpu
from glm5_hal.vendor_backend import Adapter, Verdict, dtype_name
from glm5_hal.vendor_ops.common import rope_angles, weight_cast_declined
from glm5_hal.vendor_ops.dsa import SPARSE_MLA_DECODE_PAGED, sparse_mla_decode_declined

from . import arch

if TYPE_CHECKING:
    from . import MusaBackend

_F32, _F16, _BF16, _I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "torch.rms_norm": "fp32/fp16/bf16 with the weight in x's dtype (a float32 x casts its weight exactly)",
    "torch.nn.functional.rope": "float32 (the adapter computes in float32 and rounds once); from mp_22; "
                                f"interleaved pairs need the multi_latent_attention flag (muDNN >= "
                                f"{arch.MIN_MUDNN_FOR_MLA_ROPE})",
    "mate ragged_m_moe_gemm_16bit": "grouped_gemm on mp_31: bf16/fp16, tokens per expert (gemm_mode='per_expert'); "
                                    "zero-token experts are not covered by mate's tests (unverified)",
    "mate gemm_fp8_nt_groupwise / ragged_m_moe_gemm_8bit": "fp8_block_gemm / fp8_grouped_gemm on mp_31: (1, 128, 128) "
                                                           "block scales, K-major; bf16/fp16 out only; zero-token "
                                                           "experts not covered by mate's tests (unverified)",
    "mate flash_mla_sparse_fwd": f"mp_31 only; bfloat16; Dqk {arch.FLASH_MLA_DQK}, d_v {arch.FLASH_MLA_DV}; "
                                 f"topk padded to a multiple of {arch.FLASH_MLA_TOPK_MULTIPLE}, heads to a multiple "
                                 f"of {arch.FLASH_MLA_HEAD_MULTIPLE}; its lse base by mate version",
    **gpu.KERNEL_LIMITS,
}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _generation_declined(backend: "MusaBackend", feature: str, needed: str, has: Callable) -> str | None:
    gen = backend.generation
    if gen is not None and has(gen):
        return None
    where = gen.label if gen is not None else "this device"
    return f"{feature} needs {needed}; this is {where}"


def _mate_declined(backend: "MusaBackend", behaviour: str, feature: str) -> str | None:
    """Why `feature` of mate cannot run here: the chip, mate missing, or a mate version
    outside the range `behaviour` was read from."""
    runtime = backend.runtime
    return (_generation_declined(backend, feature, "an MTT S5000 (mp_31; mate builds for MP31 only)",
                                 lambda gen: gen.mate)
            or (runtime.mate_missing if runtime.mate is None else None)
            or backend.unverified(behaviour))


# -- torch_musa ops ----------------------------------------------------------------------------
def rms_norm_supported(backend: "MusaBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return (backend.unverified("torch_musa_ops")
            or weight_cast_declined(x, weight, "the fused torch.rms_norm on musa takes the weight") or True)


def rms_norm(backend: "MusaBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    return backend.runtime.torch.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), float(eps))


def apply_rope_supported(backend: "MusaBackend", x: Tensor, positions: Tensor, theta: float,
                         interleaved: bool) -> Verdict:
    declined = backend.unverified("torch_musa_ops") or _generation_declined(
        backend, "torch.nn.functional.rope", "mp_22 or later (torch_musa tests it only there)", lambda gen: gen.rope)
    if declined:
        return declined
    if interleaved:
        mudnn = backend.chip.facts["mudnn"] if backend.chip is not None else None
        if mudnn is None or mudnn < arch.MIN_MUDNN_FOR_MLA_ROPE:
            return (f"interleaved rope uses F.rope's multi_latent_attention flag, which needs muDNN >= "
                    f"{arch.MIN_MUDNN_FOR_MLA_ROPE} (have {mudnn})")
    return True


def apply_rope(backend: "MusaBackend", x: Tensor, positions: Tensor, theta: float, interleaved: bool) -> Tensor:
    tokens, heads, rot = x.shape
    if x.numel() == 0:
        return torch.empty_like(x)
    # Raw angles [T, R]: F.rope takes cos/sin of freq_cis itself and rotates half-split
    # pairs (x[i], x[i + R/2]) with the same angle in both halves.
    angles = rope_angles(positions, rot, theta)
    freq_cis = torch.cat((angles, angles), dim=-1).contiguous()
    # float32 in and out: the only dtype torch_musa's rope tests cover, and the contract
    # computes in float32 and rounds once (bf16 cos/sin would miss it near cancellations)
    sbhd = x.to(_F32).reshape(tokens, 1, heads, rot)
    # interleaved pairs (x[2i], x[2i+1]): the MLA flag de-interleaves the input first and
    # returns the rotated halves, which are re-interleaved below
    out = backend.runtime.torch.nn.functional.rope(sbhd, freq_cis, rotary_interleaved=False,
                                                   batch_first=False, multi_latent_attention=interleaved)
    out = out.reshape(tokens, heads, rot)
    if interleaved:
        out = torch.stack((out[..., : rot // 2], out[..., rot // 2:]), dim=-1).reshape(tokens, heads, rot)
    return out.to(x.dtype)


def grouped_gemm_supported(backend: "MusaBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Verdict:
    return _mate_declined(backend, "mate_gemm", "mate's grouped GEMM") or True


def grouped_gemm(backend: "MusaBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """mate.gemm.ragged_m_moe_gemm_16bit(a [M, K], b [E, N, K], tokens per expert, out,
    gemm_mode="per_expert"): each expert's contiguous rows times its b^T (mate/gemm.py and
    tests/test_gemm.py test_m_contig_gemm_16bit, v0.1.3-v0.2.2)."""
    out = x.new_empty((x.shape[0], w.shape[1]))
    if out.numel() == 0:
        return out
    backend.runtime.mate.gemm.ragged_m_moe_gemm_16bit(
        x.contiguous(), w.contiguous(), tokens_per_expert.to(_I32).contiguous(), out,
        gemm_mode="per_expert", major_a_mode="K", major_b_mode="K")
    return out


# -- the checkpoints' FP8 GEMMs: mate's groupwise FP8 GEMMs on the S5000 ---------------------------
def _fp8_gemm_declined(backend: "MusaBackend", out_dtype: torch.dtype, feature: str) -> str | None:
    return (_mate_declined(backend, "mate_gemm", feature)
            or (None if out_dtype in HALVES else
                f"{feature} writes bfloat16 or float16 only (mate/gemm.py: \"Only bf16 and fp16 are supported for "
                f"out_type!\"), not {dtype_name(out_dtype)}"))


def fp8_block_gemm_supported(backend: "MusaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                             out_dtype: torch.dtype) -> Verdict:
    return _fp8_gemm_declined(backend, out_dtype, "mate's gemm_fp8_nt_groupwise") or True


def fp8_block_gemm(backend: "MusaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                   out_dtype: torch.dtype) -> Tensor:
    """mate.gemm.gemm_fp8_nt_groupwise(a [M, K], b [N, K], a_scale [M, K/128], b_scale
    [ceil(N/128), K/128], scale_major_mode="K", scale_granularity_mnk=(1, 128, 128)): the
    DeepSeek-V3 block format, as mate's tests/test_groupwise_fp8_scaled_gemm.py builds it."""
    rows, cols = a.shape[0], w.shape[0]
    if rows == 0 or cols == 0 or a.shape[1] == 0:   # nothing to multiply: the contract's zeros
        return a.new_zeros((rows, cols), dtype=out_dtype)
    return backend.runtime.mate.gemm.gemm_fp8_nt_groupwise(
        a.contiguous(), w.contiguous(), a_scale.contiguous(), w_scale.contiguous(), scale_major_mode="K",
        scale_granularity_mnk=(1, arch.MATE_FP8_BLOCK, arch.MATE_FP8_BLOCK), out_dtype=out_dtype)


def fp8_grouped_gemm_supported(backend: "MusaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                               tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Verdict:
    return _fp8_gemm_declined(backend, out_dtype, "mate's ragged_m_moe_gemm_8bit") or True


def fp8_grouped_gemm(backend: "MusaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                     tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Tensor:
    """mate.gemm.ragged_m_moe_gemm_8bit((a, a_scale), (b, b_scale), tokens per expert, out,
    gemm_mode="per_expert"), as mate's tests/test_gemm.py test_m_contig_gemm_8bit calls it."""
    rows, cols = a.shape[0], w.shape[1]
    out = a.new_empty((rows, cols), dtype=out_dtype)
    if rows == 0 or cols == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    block = arch.MATE_FP8_BLOCK
    backend.runtime.mate.gemm.ragged_m_moe_gemm_8bit(
        (a.contiguous(), a_scale.contiguous()), (w.contiguous(), w_scale.contiguous()),
        tokens_per_expert.to(_I32).contiguous(), out, gemm_mode="per_expert", major_a_mode="K", major_b_mode="K",
        scale_granularity_mnk=(1, block, block))
    return out


# -- sparse MLA: mate's FlashMLA on the S5000, the CUDA-dialect kernel elsewhere -----------------
def _flash_declined(backend: "MusaBackend", q: Tensor, d_v: int) -> str | None:
    dqk = q.shape[-1]
    return (_mate_declined(backend, "flash_mla_lse", "FlashMLA sparse attention")
            or (None if q.dtype == _BF16 else f"flash_mla_sparse_fwd takes bfloat16 only, got {dtype_name(q.dtype)}")
            or (None if (dqk, d_v) == (arch.FLASH_MLA_DQK, arch.FLASH_MLA_DV) else
                f"flash_mla_sparse_fwd needs Dqk {arch.FLASH_MLA_DQK} and d_v {arch.FLASH_MLA_DV}, got Dqk "
                f"{dqk}, d_v {d_v}"))


def _route(backend: "MusaBackend", q: Tensor, d_v: int, kernel_declined: str | None) -> tuple[str | None, str]:
    """('flash' | 'kernel' | None, the reason when None)."""
    flash = _flash_declined(backend, q, d_v)
    if flash is None:
        return "flash", ""
    if kernel_declined is None:
        return "kernel", ""
    return None, f"FlashMLA: {flash}; {kernel_declined}"


def _attention_route(backend: "MusaBackend", q: Tensor, kv: Tensor, d_v: int) -> tuple[str | None, str]:
    return _route(backend, q, d_v, gpu.sparse_mla_attention_declined(backend, q, kv, d_v))


def _decode_route(backend: "MusaBackend", q: Tensor, kv_cache: Tensor, d_v: int) -> tuple[str | None, str]:
    return _route(backend, q, d_v, sparse_mla_decode_declined(backend, q.shape[2], q.shape[3], d_v,
                                                              kv_cache.shape[0] * kv_cache.shape[1]))


def sparse_mla_attention_supported(backend: "MusaBackend", q: Tensor, kv: Tensor, indices: Tensor,
                                   sm_scale: float, d_v: int) -> Verdict:
    path, reason = _attention_route(backend, q, kv, d_v)
    return True if path else reason


def sparse_mla_attention(backend: "MusaBackend", q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                         d_v: int) -> tuple[Tensor, Tensor]:
    path, _ = _attention_route(backend, q, kv, d_v)
    if path == "kernel":
        return gpu.sparse_mla_attention(backend, q, kv, indices, sm_scale, d_v)
    return gpu.sparse_attention_by_rows(lambda *rows: _flash_sparse(backend, *rows, sm_scale), q, kv, indices, d_v)


def sparse_mla_decode_paged_supported(backend: "MusaBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                                      context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> Verdict:
    path, reason = _decode_route(backend, q, kv_cache, d_v)
    return True if path else reason


def sparse_mla_decode_paged(backend: "MusaBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                            context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int
                            ) -> tuple[Tensor, Tensor]:
    path, _ = _decode_route(backend, q, kv_cache, d_v)
    if path == "kernel":
        return SPARSE_MLA_DECODE_PAGED.fn(backend, q, kv_cache, block_table, context_lens, indices, sm_scale, d_v)
    return gpu.sparse_decode_by_rows(lambda *rows: _flash_sparse(backend, *rows, sm_scale), q, kv_cache,
                                     block_table, context_lens, indices, d_v)


def _flash_sparse(backend: "MusaBackend", q: Tensor, kv_rows: Tensor, rows: Tensor, valid: Tensor,
                  sm_scale: float) -> tuple[Tensor, Tensor]:
    """mate.flashmla.flash_mla_sparse_fwd over q [R, H, 576] bf16, kv_rows [S, 576], rows [R, topk]
    int32 cache rows (-1 invalid) -> the contract's (out [R, H, 512], natural-log lse [R, H])."""
    tokens, heads, dqk = q.shape
    padded_heads = _round_up(heads, arch.FLASH_MLA_HEAD_MULTIPLE)
    q_in = q.contiguous() if padded_heads == heads else torch.nn.functional.pad(q, (0, 0, 0, padded_heads - heads))
    topk = rows.shape[1]
    # -1 padding up to the kernel's 64-index tile: the tile loader would otherwise read
    # index 0 for the missing tail
    indices = torch.full((tokens, 1, _round_up(topk, arch.FLASH_MLA_TOPK_MULTIPLE)), -1, dtype=_I32,
                         device=q.device)
    indices[:, 0, :topk] = rows
    convention = backend.behaviour("flash_mla_lse")   # supports() declined unverified mate versions
    out, _max_logits, lse = backend.runtime.mate.flashmla.flash_mla_sparse_fwd(
        q_in, kv_rows.contiguous().unsqueeze(1), indices, float(sm_scale), d_v=arch.FLASH_MLA_DV)
    out = out[:, :heads].to(q.dtype)
    # mate <= 0.2.0 returns log2(sum exp), mate >= 0.2.1 the natural log (arch.FLASH_MLA_LSE)
    lse = lse[:, :heads].float() * convention.to_natural
    # a row without a valid index: the kernel's answer (a -2^30-masked finite lse up to mate
    # 0.2.0, +inf from 0.2.1) is not the contract's out 0, lse -inf
    lonely = ~valid.any(-1)
    out = out.masked_fill(lonely[:, None, None], 0.0)
    lse = lse.masked_fill(lonely[:, None], float("-inf"))
    return out.contiguous(), lse.contiguous()


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS, supports_metadata=rms_norm_supported),
    Adapter("apply_rope", apply_rope, dtypes=FLOATS, supports_metadata=apply_rope_supported),
    Adapter("grouped_gemm", grouped_gemm, dtypes=HALVES, supports_metadata=grouped_gemm_supported),
    Adapter("fp8_block_gemm", fp8_block_gemm, dtypes=(torch.float8_e4m3fn,),
            supports_metadata=fp8_block_gemm_supported),
    Adapter("fp8_grouped_gemm", fp8_grouped_gemm, dtypes=(torch.float8_e4m3fn,),
            supports_metadata=fp8_grouped_gemm_supported),
    Adapter("sparse_mla_attention", sparse_mla_attention, dtypes=FLOATS,
            supports_metadata=sparse_mla_attention_supported),
    Adapter("sparse_mla_decode_paged", sparse_mla_decode_paged, dtypes=FLOATS,
            supports_metadata=sparse_mla_decode_paged_supported),
    gpu.SILU_AND_MUL, gpu.KV_CACHE_WRITE, gpu.INDEXER_TOPK, gpu.INDEXER_TOPK_PAGED, gpu.MOE_PERMUTE, gpu.MOE_UNPERMUTE,
)
