"""Vendor adapter helpers of the DSA ops (docs/ops/dsa.md): attention head padding, and the
paged sparse MLA decode kernel that the CUDA-dialect (musa, dcu, iluvatar, cuda), cambricon
and kunlun kernel libraries implement behind one entry point, declared in
include/glm5_hal_kernel_abi.h: its argument struct (mirrored field for field,
tests/test_kernel_abi.py), its launcher (`SparseMlaDecodeLibrary.sparse_mla_decode_paged`),
the sizes each implementation takes (`DecodeLimits`) and the one adapter all of them serve
(`SPARSE_MLA_DECODE_PAGED`)."""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch
from torch import Tensor

from ..kernel_library import DTYPE_CODE, KernelLibrary, pointer
from ..vendor_backend import INT32_MAX, Adapter, Verdict


def pad_heads(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """`t` with dim `dim` (heads) zero-padded to `heads`, contiguous."""
    if t.shape[dim] == heads:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = heads
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


# -- the paged sparse MLA decode kernel ----------------------------------------------------------
SPARSE_MLA_DECODE = "glm5_hal_sparse_mla_decode_paged"


class SparseMlaDecodeArgs(ctypes.Structure):
    """glm5_hal_sparse_mla_decode_args of glm5_hal_kernel_abi.h, field for field."""
    _fields_ = [("q", ctypes.c_void_p), ("kv_cache", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("context_lens", ctypes.c_void_p), ("indices", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("lse", ctypes.c_void_p),
                ("batch", ctypes.c_int64), ("queries_per_seq", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("dqk", ctypes.c_int64), ("d_v", ctypes.c_int64), ("topk", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64), ("block_size", ctypes.c_int64), ("max_blocks", ctypes.c_int64),
                ("sm_scale", ctypes.c_float), ("dtype", ctypes.c_int32)]


@dataclasses.dataclass(frozen=True)
class DecodeLimits:
    """The sizes one implementation of the decode kernel takes (its host code refuses others
    with EINVAL; the adapter declines them first, with this reason)."""
    kernel: str                   # names it in reasons: "the BANG C sparse decode kernel"
    max_dqk: int
    max_heads: int
    max_d_v: int | None = None    # None: any d_v <= Dqk (the contract's bound)
    int32_rows: bool = False      # addresses cache rows with int32

    def declined(self, heads: int, dqk: int, d_v: int, cache_rows: int) -> str | None:
        if dqk > self.max_dqk:
            return f"{self.kernel} takes Dqk <= {self.max_dqk}, got {dqk}"
        if self.max_d_v is not None and d_v > self.max_d_v:
            return f"{self.kernel} takes d_v <= {self.max_d_v}, got {d_v}"
        if heads > self.max_heads:
            return f"{self.kernel} takes H <= {self.max_heads}, got {heads}"
        if self.int32_rows and cache_rows > INT32_MAX:
            return f"{self.kernel} addresses cache rows with int32"
        return None


class SparseMlaDecodeLibrary(KernelLibrary):
    """A kernel library exporting glm5_hal_sparse_mla_decode_paged; subclasses state the
    implementation's `decode_limits` (and add their other entry points to `signatures`)."""
    signatures = {SPARSE_MLA_DECODE: (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p])}
    decode_limits: DecodeLimits

    def sparse_mla_decode_paged(self, q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                                indices: Tensor, sm_scale: float, d_v: int, stream: int) -> tuple[Tensor, Tensor]:
        """q [B, N, H, Dqk], kv_cache [num_blocks, block_size, Dqk], block_table [B, max_blocks],
        context_lens [B], indices [B, N, topk] logical positions, all on the device, validated
        by glm5_hal.ops -> (out [B, N, H, d_v] in q's dtype, lse float32 [B, N, H]), enqueued on
        `stream`."""
        batch, queries, heads, dqk = q.shape
        out = q.new_empty((batch, queries, heads, d_v))
        lse = q.new_empty((batch, queries, heads), dtype=torch.float32)
        if lse.numel() == 0:
            return out, lse
        q, kv_cache = q.contiguous(), kv_cache.contiguous()
        table, lens, idx = (t.to(torch.int32).contiguous() for t in (block_table, context_lens, indices))
        args = SparseMlaDecodeArgs(
            pointer(q), pointer(kv_cache), pointer(table), pointer(lens), pointer(idx), pointer(out), pointer(lse),
            batch, queries, heads, dqk, d_v, idx.shape[-1], kv_cache.shape[0], kv_cache.shape[1], table.shape[1],
            float(sm_scale), DTYPE_CODE[q.dtype])
        self.launch(SPARSE_MLA_DECODE, ctypes.byref(args), stream)
        return out, lse


def sparse_mla_decode_declined(backend: Any, heads: int, dqk: int, d_v: int, cache_rows: int) -> str | None:
    """Why `backend`'s decode kernel cannot take a call of these sizes (None: it can)."""
    kernels = backend.kernels
    return kernels.missing() or kernels.decode_limits.declined(heads, dqk, d_v, cache_rows)


# The adapter of every backend that serves sparse_mla_decode_paged with its own decode
# kernel: the backend has `kernels` (a SparseMlaDecodeLibrary) and `stream(device)` (the raw
# handle of its framework's current stream).
def sparse_mla_decode_paged_supported(backend: Any, q: Tensor, kv_cache: Tensor, block_table: Tensor,
                                      context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> Verdict:
    return sparse_mla_decode_declined(backend, q.shape[2], q.shape[3], d_v,
                                      kv_cache.shape[0] * kv_cache.shape[1]) or True


def sparse_mla_decode_paged(backend: Any, q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                            indices: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    return backend.kernels.sparse_mla_decode_paged(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v,
                                                   backend.stream(q.device))


SPARSE_MLA_DECODE_PAGED = Adapter("sparse_mla_decode_paged", sparse_mla_decode_paged,
                                  dtypes=(torch.float32, torch.float16, torch.bfloat16),
                                  supports_metadata=sparse_mla_decode_paged_supported)
