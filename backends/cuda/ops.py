"""Adapters from glm5_hal's canonical ops to what an NVIDIA GPU offers: torch's own CUDA ops,
FlashMLA and DeepGEMM when installed, and the backend's own kernels (the CUDA-dialect sources
built with nvcc).

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
CudaBackend instance binds to itself; it reaches the vendor through `backend.runtime`
(CudaRuntime over the real modules, or the emulator in tests), so several instances coexist.
Inputs arrive validated by glm5_hal.ops; an adapter converts layouts and index conventions,
calls the library and returns exactly the canonical outputs. Each `supports()` checks the
library's per-call constraints (device generation, dtype, shapes, installed and verified
versions) and returns a reason when the call falls outside them, so dispatch moves on.

No adapter synchronises with the device per call: layouts, paddings and masks are built on
the device, and workspaces are sized from shapes (the kernels bound every row by its own
range). The one exception is moe_permute, whose output size is the data (the contract's
shape), read once. README.md has the table.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from glm5_hal.backends._cuda_dialect import adapters as gpu
from glm5_hal.kernel_library import SPARSE_MLA_DECODE_PAGED, sparse_mla_decode_declined
from glm5_hal.vendor_backend import (INT32_MAX, Adapter, Verdict, dtype_name, first_reason, pad_heads,
                                     weight_cast_declined)

from . import arch

if TYPE_CHECKING:
    from . import CudaBackend

_F32, _F16, _BF16, _I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
FLOATS = (_F32, _F16, _BF16)
#: the logits grid of the indexer kernel has one block row per 128 keys (gridDim.y <= 65535)
INDEXER_MAX_KEYS = 65535 * 128
#: dense decode through the sparse kernel materialises [B, N, max_blocks * block_size] positions
DENSE_MAX_POSITIONS = 1 << 28

#: The constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "torch.rms_norm": "the fused CUDA kernel (torch >= 2.11 verified); weight in x's dtype",
    "torch._grouped_mm": "bf16 on sm_90 / sm_100 (its CUTLASS path); other dtypes and GPUs loop per group after "
                         "copying the offsets to the host, a sync per call: declined",
    "flash_mla_sparse_fwd": "sparse_mla_attention and sparse_mla_decode_paged (over the flattened cache): bf16, "
                            "Dqk 576 (or 512 from interface 2) and d_v 512, sm_90 (interface 1) or sm_90 / sm_100 "
                            f"(interface 2); heads padded to 64 or 128 (or run in chunks), top-k to a multiple of "
                            f"{arch.FLASH_MLA_TOPK_MULTIPLE} with -1",
    "flash_mla_with_kvcache": arch.FLASH_MLA_DECODE_KERNEL_DECLINED.format(dtype="bf16 / fp16 / fp32"),
    "kernels: dense_mla_decode_paged": "the sparse decode kernel over every position of the block table "
                                       f"(at most {DENSE_MAX_POSITIONS} positions per call)",
    **gpu.KERNEL_LIMITS,
}


def _sm(backend: "CudaBackend") -> str:
    return "sm_{}{}".format(*backend.capability)


# -- torch's own CUDA ops: rms_norm, grouped_gemm --------------------------------------------------
def rms_norm_supported(backend: "CudaBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return first_reason(
        lambda: backend.unverified(arch.TORCH_FUSED_RMS_NORM.name),
        lambda: weight_cast_declined(x, weight, "torch.rms_norm's fused CUDA kernel takes the weight"))


def rms_norm(backend: "CudaBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    # eps is passed always: None would mean torch.finfo(x.dtype).eps
    return backend.runtime.torch.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), float(eps))


def grouped_gemm_supported(backend: "CudaBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Verdict:
    behaviour = arch.TORCH_GROUPED_MM.name
    return first_reason(
        lambda: backend.unverified(behaviour),
        lambda: None if x.dtype == _BF16 else
        f"torch._grouped_mm runs {dtype_name(x.dtype)} as one mm per group after copying the offsets to the host "
        "(a device sync per call); its CUTLASS path takes bf16",
        lambda: None if backend.capability[0] in backend.behaviour(behaviour) else
        f"torch._grouped_mm's CUTLASS path runs on sm_90 and sm_100; on {_sm(backend)} it loops per group after "
        "copying the offsets to the host (a device sync per call)")


def grouped_gemm(backend: "CudaBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    return gpu.grouped_mm(backend.runtime.torch, x, w, tokens_per_expert)


# -- sparse MLA: FlashMLA on sm_90 / sm_100 for bf16, else the CUDA-dialect kernel ------------------
_FLASH_BEHAVIOURS = (arch.FLASH_MLA_SPARSE_LSE.name, arch.FLASH_MLA_SPARSE_HEADS.name, arch.FLASH_MLA_SPARSE_DIMS.name)


def _flash_declined(backend: "CudaBackend", q: Tensor, dqk: int, d_v: int, kv_rows: int) -> str | None:
    """Why flash_mla_sparse_fwd cannot take this call (None: it can)."""
    if q.dtype != _BF16:
        return f"flash_mla_sparse_fwd takes bfloat16 only, got {dtype_name(q.dtype)}"
    runtime = backend.runtime
    if runtime.flash_mla is None:
        return runtime.flash_mla_missing
    for name in _FLASH_BEHAVIOURS:
        reason = backend.unverified(name)
        if reason:
            return reason
    heads = backend.behaviour(arch.FLASH_MLA_SPARSE_HEADS.name)
    major, minor = backend.capability
    if major not in heads or (major == 9 and minor != 0):
        level = backend.chip.versions.get(arch.FLASH_MLA_PACKAGE) if backend.chip else None
        return (f"flash_mla_sparse_fwd (interface {level}) runs on "
                f"{' and '.join(f'sm_{m}0' for m in sorted(heads))}; this is {_sm(backend)}")
    dims = backend.behaviour(arch.FLASH_MLA_SPARSE_DIMS.name)
    if (dqk, d_v) not in dims:
        return (f"flash_mla_sparse_fwd takes (Dqk, d_v) in {list(dims)}, got ({dqk}, {d_v})")
    if kv_rows * dqk > INT32_MAX:
        return "flash_mla_sparse_fwd passes strides as int32; this cache has more than 2^31 elements"
    return None


def _route(flash: str | None, kernel: str | None) -> tuple[str | None, str]:
    """('flash' | 'kernel' | None, the reason when None)."""
    if flash is None:
        return "flash", ""
    if kernel is None:
        return "kernel", ""
    return None, f"FlashMLA: {flash}; {kernel}"


def _attention_route(backend: "CudaBackend", q: Tensor, kv: Tensor, d_v: int) -> tuple[str | None, str]:
    return _route(_flash_declined(backend, q, q.shape[-1], d_v, kv.shape[0]),
                  gpu.sparse_mla_attention_declined(backend, q, kv, d_v))


def _decode_route(backend: "CudaBackend", q: Tensor, kv_cache: Tensor, d_v: int) -> tuple[str | None, str]:
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    flash = _flash_declined(backend, q, q.shape[-1], d_v, rows) or (
        None if kv_cache.is_contiguous() else
        "flash_mla_sparse_fwd reads the cache as one [rows, 1, Dqk] tensor; this cache is not contiguous")
    return _route(flash, sparse_mla_decode_declined(backend, q.shape[2], q.shape[3], d_v, rows))


def sparse_mla_attention_supported(backend: "CudaBackend", q: Tensor, kv: Tensor, indices: Tensor,
                                   sm_scale: float, d_v: int) -> Verdict:
    path, reason = _attention_route(backend, q, kv, d_v)
    return True if path else reason


def sparse_mla_attention(backend: "CudaBackend", q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                         d_v: int) -> tuple[Tensor, Tensor]:
    path, _ = _attention_route(backend, q, kv, d_v)
    if path == "kernel":
        return gpu.sparse_mla_attention(backend, q, kv, indices, sm_scale, d_v)
    if q.shape[0] == 0 or kv.shape[0] == 0:
        return gpu.no_valid_rows(q, d_v, (q.shape[0],))
    valid = (indices >= 0) & (indices < kv.shape[0])
    return _flash_sparse(backend, q, kv, torch.where(valid, indices, -1).to(_I32), valid, sm_scale, d_v)


def sparse_mla_decode_paged_supported(backend: "CudaBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                                      context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> Verdict:
    path, reason = _decode_route(backend, q, kv_cache, d_v)
    return True if path else reason


def sparse_mla_decode_paged(backend: "CudaBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                            context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int
                            ) -> tuple[Tensor, Tensor]:
    path, _ = _decode_route(backend, q, kv_cache, d_v)
    if path == "kernel":
        return SPARSE_MLA_DECODE_PAGED.fn(backend, q, kv_cache, block_table, context_lens, indices, sm_scale, d_v)
    batch, queries, heads, dqk = q.shape
    if q.numel() == 0 or kv_cache.shape[0] == 0:
        return gpu.no_valid_rows(q, d_v, (batch, queries))
    rows, valid = gpu.paged_to_physical(indices, block_table, context_lens, kv_cache.shape[1],
                                        num_blocks=kv_cache.shape[0])
    out, lse = _flash_sparse(backend, q.reshape(batch * queries, heads, dqk), kv_cache.view(-1, dqk),
                             rows.reshape(batch * queries, -1), valid.reshape(batch * queries, -1), sm_scale, d_v)
    return out.view(batch, queries, heads, d_v), lse.view(batch, queries, heads)


def _flash_sparse(backend: "CudaBackend", q: Tensor, kv_rows: Tensor, rows: Tensor, valid: Tensor, sm_scale: float,
                  d_v: int) -> tuple[Tensor, Tensor]:
    """flash_mla_sparse_fwd over q [R, H, Dqk] bf16, kv_rows [S, Dqk], rows [R, topk] int32 cache
    rows (-1 invalid) -> the contract's (out [R, H, d_v], natural-log lse [R, H])."""
    tokens, heads, _ = q.shape
    allowed = backend.behaviour(arch.FLASH_MLA_SPARSE_HEADS.name)[backend.capability[0]]
    group = next((h for h in allowed if h >= heads), max(allowed))   # pad up to it, or run chunks of it
    topk = rows.shape[1]
    # -1 up to the kernel's top-k tile: it loads whole tiles of indices
    indices = torch.full((tokens, 1, -(-topk // arch.FLASH_MLA_TOPK_MULTIPLE) * arch.FLASH_MLA_TOPK_MULTIPLE), -1,
                         dtype=_I32, device=q.device)
    indices[:, 0, :topk] = rows
    kv = kv_rows.contiguous().unsqueeze(1)                          # [S, h_kv = 1, Dqk]
    outs, lses = [], []
    for first in range(0, heads, group):
        chunk = q[:, first:first + group]
        out, _max_logits, lse = backend.runtime.flash_mla.flash_mla_sparse_fwd(
            pad_heads(chunk, group, 1), kv, indices, float(sm_scale), d_v=d_v)
        outs.append(out[:, :chunk.shape[1]])
        lses.append(lse[:, :chunk.shape[1]])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)).float()
    base = backend.behaviour(arch.FLASH_MLA_SPARSE_LSE.name)
    if base != math.e:
        lse = lse * math.log(base)
    # a row without a valid index: out 0 and lse -inf in the contract (FlashMLA: -inf or +inf)
    lonely = ~valid.any(-1)
    out = out.masked_fill(lonely[:, None, None], 0.0)
    lse = lse.masked_fill(lonely[:, None], float("-inf"))
    return out.to(q.dtype).contiguous(), lse.contiguous()


# -- the CUDA-dialect kernels -----------------------------------------------------------------------
def dense_mla_decode_paged_supported(backend: "CudaBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                                     context_lens: Tensor, sm_scale: float, d_v: int) -> Verdict:
    positions = q.shape[0] * q.shape[1] * block_table.shape[1] * kv_cache.shape[1]
    return first_reason(
        lambda: sparse_mla_decode_declined(backend, q.shape[2], q.shape[3], d_v,
                                           kv_cache.shape[0] * kv_cache.shape[1]),
        lambda: None if positions <= DENSE_MAX_POSITIONS else
        f"dense decode through the sparse kernel lists every block-table position: {positions} > "
        f"{DENSE_MAX_POSITIONS}")


def dense_mla_decode_paged(backend: "CudaBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                           context_lens: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """The sparse decode kernel over every position of the block table: query i of N sees
    [0, context_lens[b] - N + i + 1), the rest is -1. The bound comes from the shapes, so
    nothing is read back from the device; the kernel skips tiles without a valid position."""
    batch, queries = q.shape[0], q.shape[1]
    width = block_table.shape[1] * kv_cache.shape[1]
    if q.numel() == 0 or width == 0:
        return gpu.no_valid_rows(q, d_v, (batch, queries))
    positions = torch.arange(width, dtype=_I32, device=q.device)
    visible = (context_lens.to(_I32).view(batch, 1, 1) - queries + 1
               + torch.arange(queries, dtype=_I32, device=q.device).view(1, queries, 1))
    indices = torch.where(positions.view(1, 1, width) < visible, positions.view(1, 1, width), -1).to(_I32)
    return backend.kernels.sparse_mla_decode_paged(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v,
                                                   backend.stream(q.device))


def _indexer_declined(backend: "CudaBackend", q: Tensor, keys: int) -> str | None:
    if keys > INDEXER_MAX_KEYS:
        return f"the indexer kernel scores at most {INDEXER_MAX_KEYS} keys per call, got {keys}"
    return gpu.indexer_shape_declined(q)


def indexer_topk_supported(backend: "CudaBackend", q: Tensor, k: Any, weights: Tensor, k_start: Tensor,
                           k_end: Tensor, topk: int) -> Verdict:
    keys, _ = gpu.split_key(k)
    return first_reason(backend.kernels.missing, lambda: _indexer_declined(backend, q, keys.shape[0]))


def indexer_topk(backend: "CudaBackend", q: Tensor, k: Any, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    keys, scale = gpu.split_key(k)
    # every range lies in [0, S): S bounds the workspace row without reading the ranges back
    return backend.kernels.indexer_topk(q, keys, scale, weights, k_start, k_end, topk, backend.stream(q.device),
                                        span=keys.shape[0])


def indexer_topk_paged_supported(backend: "CudaBackend", q: Tensor, k_cache: Any, weights: Tensor,
                                 block_table: Tensor, context_lens: Tensor, topk: int) -> Verdict:
    keys, _ = gpu.split_key(k_cache)
    return first_reason(backend.kernels.missing,
                        lambda: _indexer_declined(backend, q, block_table.shape[1] * keys.shape[1]))


def indexer_topk_paged(backend: "CudaBackend", q: Tensor, k_cache: Any, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    keys, scale = gpu.split_key(k_cache)
    # a context never exceeds what its block-table row addresses
    return backend.kernels.indexer_topk_paged(q, keys, scale, weights, block_table, context_lens, topk,
                                              backend.stream(q.device), span=block_table.shape[1] * keys.shape[1])


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS, supports=rms_norm_supported),
    Adapter("grouped_gemm", grouped_gemm, dtypes=FLOATS, supports=grouped_gemm_supported),
    Adapter("sparse_mla_attention", sparse_mla_attention, dtypes=FLOATS, supports=sparse_mla_attention_supported),
    Adapter("sparse_mla_decode_paged", sparse_mla_decode_paged, dtypes=FLOATS,
            supports=sparse_mla_decode_paged_supported),
    Adapter("dense_mla_decode_paged", dense_mla_decode_paged, dtypes=FLOATS,
            supports=dense_mla_decode_paged_supported),
    Adapter("indexer_topk", indexer_topk, dtypes=FLOATS, supports=indexer_topk_supported),
    Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=FLOATS, supports=indexer_topk_paged_supported),
    gpu.SILU_AND_MUL, gpu.KV_CACHE_WRITE, gpu.MOE_PERMUTE, gpu.MOE_UNPERMUTE,
)
