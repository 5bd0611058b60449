"""Adapters from glm5_hal's canonical ops to what an NVIDIA GPU offers: torch's own CUDA ops,
FlashMLA and DeepGEMM when installed, and the backend's own kernels (the CUDA-dialect sources
built with nvcc).

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
CudaBackend instance binds to itself; it reaches the vendor through `backend.runtime`
(CudaRuntime over the real modules, or the emulator in tests), so several instances coexist.
Inputs arrive validated by glm5_hal.ops; an adapter converts layouts and index conventions,
calls the library and returns exactly the canonical outputs. Each adapter's predicate checks the
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
from glm5_hal.vendor_backend import INT32_MAX, Adapter, Verdict, dtype_name, first_reason
from glm5_hal.vendor_ops.common import weight_cast_declined
from glm5_hal.vendor_ops.dsa import SPARSE_MLA_DECODE_PAGED, pad_heads, sparse_mla_decode_declined

from . import arch

if TYPE_CHECKING:
    from . import CudaBackend

_F32, _F16, _BF16, _I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
_FP8, _U8 = torch.float8_e4m3fn, torch.uint8
FLOATS = (_F32, _F16, _BF16)
#: the FP8 GEMMs' scale block (docs/ops/quant.md): 1 x 128 for activations, 128 x 128 for weights
BLOCK = 128
#: the logits grid of the indexer kernel has one block row per 128 keys (gridDim.y <= 65535)
INDEXER_MAX_KEYS = 65535 * 128
#: dense decode through the sparse kernel materialises [B, N, max_blocks * block_size] positions
DENSE_MAX_POSITIONS = 1 << 28

#: The constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "torch.rms_norm": "the fused CUDA kernel (torch 2.11 - 2.15 verified); weight in x's dtype",
    "torch._grouped_mm": "bf16 on sm_90 / sm_100 (its CUTLASS path); other dtypes and GPUs loop per group after "
                         "copying the offsets to the host, a sync per call: declined",
    "flash_mla_sparse_fwd": "sparse_mla_attention and sparse_mla_decode_paged (over the flattened cache): bf16, "
                            "Dqk 576 (or 512 from interface 2) and d_v 512, sm_90 (interface 1) or sm_90 / sm_100 "
                            f"(interface 2); heads padded to 64 or 128 (or run in chunks), top-k to a multiple of "
                            f"{arch.FLASH_MLA_TOPK_MULTIPLE} with -1",
    "flash_mla_with_kvcache": arch.FLASH_MLA_DECODE_KERNEL_DECLINED.format(dtype="bf16 / fp16 / fp32"),
    "deep_gemm fp8_gemm_nt / m_grouped_fp8_gemm_nt_contiguous": "fp8_block_gemm / fp8_grouped_gemm on sm_90, "
                                                                "bf16 output, N % 8 == 0 (16-byte TMA rows); "
                                                                "grouped rows re-laid per expert on 128-row "
                                                                "boundaries on the device",
    "torch._scaled_mm": "fp8_block_gemm on sm_90 (1x128 x 128x128 scales), bf16 output, K and N % 16 == 0; "
                        "where ceil(K/128) % 4 != 0 and N > 128, K is zero-padded to a multiple of 512 "
                        "(cuBLASLt reads the weight scales "
                        "with ceil(K/128) rounded up to 4; torch._scaled_mm takes them only unpadded)",
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
    return gpu.sparse_attention_by_rows(
        lambda *rows: _flash_sparse(backend, *rows, sm_scale, d_v), q, kv, indices, d_v)


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
    return gpu.sparse_decode_by_rows(lambda *rows: _flash_sparse(backend, *rows, sm_scale, d_v), q, kv_cache,
                                     block_table, context_lens, indices, d_v)


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


# -- FP8 GEMMs on the checkpoints' block scales: DeepGEMM, else torch._scaled_mm -----------------
def _deep_gemm_declined(backend: "CudaBackend", n: int, out_dtype: torch.dtype, op: str) -> str | None:
    runtime = backend.runtime
    if runtime.deep_gemm is None:
        return runtime.deep_gemm_missing
    reason = backend.unverified(arch.DEEP_GEMM_CONTIGUOUS_LAYOUT.name)
    if reason:
        return reason
    major = backend.capability[0]
    if major == 10:
        return arch.DEEP_GEMM_SM100_DECLINED
    if major != 9:
        return f"DeepGEMM runs on sm_90 and sm_100; this is {_sm(backend)}"
    if out_dtype != _BF16:
        return (f"DeepGEMM's sm_90 {op} for 128 x 128 weight scales writes bf16 only, not "
                f"{dtype_name(out_dtype)} (sm90_fp8_gemm_1d2d)")
    if n % 8:
        return f"DeepGEMM's TMA writes 16-byte output rows: N % 8 == 0, got N = {n}"
    return None


def _scaled_mm_declined(backend: "CudaBackend", k: int, n: int, out_dtype: torch.dtype) -> str | None:
    behaviour = arch.TORCH_SCALED_MM_BLOCKWISE.name
    reason = backend.unverified(behaviour)
    if reason:
        return reason
    if backend.capability[0] not in backend.behaviour(behaviour):
        return f"torch._scaled_mm's 1x128 x 128x128 scaling runs on sm_90 only; this is {_sm(backend)}"
    if out_dtype != _BF16:
        return f"torch._scaled_mm with block scales: only a bf16 output is verified, not {dtype_name(out_dtype)}"
    if n % 16 or k % 16:
        return f"torch._scaled_mm (cuBLASLt) needs K and N multiples of 16, got K = {k}, N = {n}"
    return None


def _scaled_mm_padded_k_blocks(k: int, n: int) -> int | None:
    """cuBLASLt reads the 128x128 weight scales as [L4, ceil(N/128)] K-major, L4 = ceil(K/128)
    rounded up to 4 (pytorch test/test_scaled_matmul_cuda.py @00166b21, _pad_128x128_scales);
    torch._scaled_mm checks them for the unpadded stride ceil(K/128) and passes only the
    pointer (ScaledBlas.cpp is_blockwise_128x128_scaling @0174dfab, the same in the 2.11 - 2.15
    wheels). The two layouts agree when ceil(K/128) is a multiple of 4 or there is one row of
    weight blocks; otherwise this returns the K-block count (L4) to zero-pad the operands to,
    after which they agree again (arch.SCALED_MM_SCALE_K_BLOCKS_MULTIPLE)."""
    k_blocks, n_blocks = -(-k // BLOCK), -(-n // BLOCK)
    multiple = arch.SCALED_MM_SCALE_K_BLOCKS_MULTIPLE
    if k_blocks % multiple == 0 or n_blocks <= 1:
        return None
    return -(-k_blocks // multiple) * multiple


def _pad_k(x: Tensor, scale: Tensor, k_blocks: int) -> tuple[Tensor, Tensor]:
    """x [R, K] fp8 and its scales [S, ceil(K/128)] extended to K = k_blocks * 128 with zero
    codes (0x00 is +0 in e4m3) and unit scales: the added products are exactly 0."""
    columns = k_blocks * BLOCK - x.shape[1]
    padded = torch.nn.functional.pad(x.view(_U8), (0, columns)).view(_FP8)
    return padded, torch.nn.functional.pad(scale, (0, k_blocks - scale.shape[1]), value=1.0)


def _empty_product(a: Tensor, n: int, out_dtype: torch.dtype) -> Tensor | None:
    """The result when there is nothing to multiply (M, N or K zero: DeepGEMM 2.1 asserts
    n > 0 and k > 0), else None."""
    if a.shape[0] == 0 or n == 0 or a.shape[1] == 0:
        return torch.zeros((a.shape[0], n), dtype=out_dtype, device=a.device)
    return None


def _fp8_block_gemm_route(backend: "CudaBackend", a: Tensor, w: Tensor, out_dtype: torch.dtype
                          ) -> tuple[str | None, str]:
    n, k = w.shape[0], a.shape[1]
    deep = _deep_gemm_declined(backend, n, out_dtype, "fp8_gemm_nt")
    if deep is None:
        return "deep_gemm", ""
    scaled = _scaled_mm_declined(backend, k, n, out_dtype)
    if scaled is None:
        return "scaled_mm", ""
    return None, f"DeepGEMM: {deep}; {scaled}"


def fp8_block_gemm_supported(backend: "CudaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                             out_dtype: torch.dtype) -> Verdict:
    path, reason = _fp8_block_gemm_route(backend, a, w, out_dtype)
    return True if path else reason


def fp8_block_gemm(backend: "CudaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                   out_dtype: torch.dtype) -> Tensor:
    empty = _empty_product(a, w.shape[0], out_dtype)
    if empty is not None:
        return empty
    path, _ = _fp8_block_gemm_route(backend, a, w, out_dtype)
    a, w, a_scale, w_scale = a.contiguous(), w.contiguous(), a_scale.contiguous(), w_scale.contiguous()
    if path == "deep_gemm":
        out = torch.empty((a.shape[0], w.shape[0]), dtype=_BF16, device=a.device)
        backend.runtime.deep_gemm.fp8_gemm_nt((a, a_scale), (w, w_scale), out)
        return out
    # cuBLASLt's DeepSeek recipe: A row-major with 1x128 scales outer-dim-major [M, K/128],
    # B = w^T column-major with 128x128 scales given as the transpose of [N/128, K/128]. Where
    # that unpadded buffer is not cuBLASLt's padded layout, K is zero-padded until they agree:
    # one copy of a and w per call (N * K bytes of weight), never taken by GLM-5's K (multiples
    # of 512), and cheaper than the reference's dequantised float32 weight
    padded_blocks = _scaled_mm_padded_k_blocks(a.shape[1], w.shape[0])
    if padded_blocks is not None:
        a, a_scale = _pad_k(a, a_scale, padded_blocks)
        w, w_scale = _pad_k(w, w_scale, padded_blocks)
    return backend.runtime.torch._scaled_mm(a, w.t(), a_scale.t().contiguous().t(), w_scale.t(),
                                           out_dtype=out_dtype, use_fast_accum=False)


def fp8_grouped_gemm_supported(backend: "CudaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                               tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Verdict:
    return _deep_gemm_declined(backend, w.shape[1], out_dtype, "m_grouped_fp8_gemm_nt_contiguous") or True


def fp8_grouped_gemm(backend: "CudaBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                     tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Tensor:
    """DeepGEMM's contiguous layout wants each expert's rows to start on a multiple of its
    alignment (128), padding rows marked -1; the contract's rows are packed. The rows are
    copied into a buffer sized for the worst case, M + E * (alignment - 1) rounded up, at
    positions computed on the device, and gathered back after the GEMM."""
    empty = _empty_product(a, w.shape[1], out_dtype)
    if empty is not None:
        return empty
    deep_gemm = backend.runtime.deep_gemm
    align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    rows, experts, device = a.shape[0], w.shape[0], a.device
    capacity = -(-(rows + experts * (align - 1)) // align) * align
    counts = tokens_per_expert.to(torch.int64)
    ends = counts.cumsum(0)
    padded = (counts + align - 1) // align * align
    padded_starts = padded.cumsum(0) - padded
    row = torch.arange(rows, device=device)
    expert = torch.searchsorted(ends, row, right=True)                   # the expert of each row
    target = padded_starts[expert] + row - (ends - counts)[expert]       # its row in the padded layout
    a_pad = torch.zeros((capacity, a.shape[1]), dtype=_U8, device=device)
    a_pad.index_copy_(0, target, a.contiguous().view(_U8))
    scale_pad = torch.zeros((capacity, a_scale.shape[1]), dtype=_F32, device=device)
    scale_pad.index_copy_(0, target, a_scale.contiguous())
    layout = torch.full((capacity,), -1, dtype=_I32, device=device)
    layout.index_copy_(0, target, expert.to(_I32))
    out = torch.empty((capacity, w.shape[1]), dtype=_BF16, device=device)
    # 4th argument: m_indices (2.1) / grouped_layout (2.3+), per-row ids either way (positional)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_pad.view(_FP8), scale_pad), (w.contiguous(), w_scale.contiguous()),
                                               out, layout)
    return out.index_select(0, target)


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS, supports_metadata=rms_norm_supported),
    Adapter("grouped_gemm", grouped_gemm, dtypes=FLOATS, supports_metadata=grouped_gemm_supported),
    Adapter("sparse_mla_attention", sparse_mla_attention, dtypes=FLOATS,
            supports_metadata=sparse_mla_attention_supported),
    # per call: FlashMLA reads a contiguous cache (the call key holds only whether it is paged)
    Adapter("sparse_mla_decode_paged", sparse_mla_decode_paged, dtypes=FLOATS,
            supports=sparse_mla_decode_paged_supported),
    Adapter("dense_mla_decode_paged", dense_mla_decode_paged, dtypes=FLOATS,
            supports_metadata=dense_mla_decode_paged_supported),
    Adapter("indexer_topk", indexer_topk, dtypes=FLOATS, supports_metadata=indexer_topk_supported),
    Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=FLOATS, supports_metadata=indexer_topk_paged_supported),
    Adapter("fp8_block_gemm", fp8_block_gemm, dtypes=(_FP8,), supports_metadata=fp8_block_gemm_supported),
    Adapter("fp8_grouped_gemm", fp8_grouped_gemm, dtypes=(_FP8,), supports_metadata=fp8_grouped_gemm_supported),
    gpu.SILU_AND_MUL, gpu.KV_CACHE_WRITE, gpu.MOE_PERMUTE, gpu.MOE_UNPERMUTE,
)
