"""Python side of the CUDA-dialect kernels (README.md in this folder): a ctypes loader for the
library one GPU toolchain built from src/*.cu, and launchers that turn tensors into the raw
pointers, sizes and stream of the C ABI (include/glm5_hal_gpu.h; the sparse MLA decode
kernel's entry point and launcher are the ones every kernel library shares, in
glm5_hal.vendor_ops.dsa).

Used by the cuda backend (libglm5_hal_cuda_kernels.so, built by nvcc), the musa backend
(libglm5_hal_musa_kernels.so, built by mcc) and the dcu backend (libglm5_hal_dcu_kernels.so,
built by hipcc). The library is loaded lazily; when it is absent, `missing()` says so and the
adapters that need it decline, so dispatch moves on.

Launchers take validated inputs (glm5_hal.ops has checked them), make them contiguous,
allocate outputs on the inputs' device and return the canonical outputs of the op.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from glm5_hal.kernel_library import (  # noqa: F401 (DTYPE_CODE, OK, EINVAL, KernelError re-exported)
    DTYPE_CODE, EINVAL, OK, KernelError, library_path, pointer as _ptr)
from glm5_hal.vendor_ops.dsa import DecodeLimits, SparseMlaDecodeLibrary

HERE = Path(__file__).resolve().parent
HEADER = HERE / "include" / "glm5_hal_gpu.h"
SOURCES = HERE / "src"

#: mirrors of include/glm5_hal_gpu.h (tests/test_cuda_dialect.py checks they agree)
ABI_VERSION = 2
MLA_MAX_DQK = 1024
MLA_MAX_DV = 1024
INDEXER_MAX_QROW = 8192
INDEXER_MAX_HEADS = 1024
#: float32 logits the indexer launchers keep at once; longer calls run in row chunks
WORKSPACE_BUDGET_BYTES = 256 << 20

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float

#: restype and argtypes of every entry point, in the header's order
SIGNATURES: dict[str, tuple[object, list]] = {
    "glm5_hal_gpu_target": (ctypes.c_char_p, []),
    "glm5_hal_gpu_abi_version": (_I, []),
    **SparseMlaDecodeLibrary.signatures,
    "glm5_hal_gpu_indexer_topk": (_I, [_P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64,
                                       _I, _I, _P]),
    "glm5_hal_gpu_indexer_topk_paged": (_I, [_P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64,
                                             _I64, _I64, _I64, _I64, _I, _I, _P]),
    "glm5_hal_gpu_kv_cache_write": (_I, [_P, _P, _P, _I, _I64, _I64, _I64, _P]),
    "glm5_hal_gpu_silu_and_mul": (_I, [_P, _P, _I64, _I64, _I, _P]),
    "glm5_hal_gpu_moe_permute_index": (_I, [_P, _I64, _I64, _I64, _P, _P, _P]),
    "glm5_hal_gpu_gather_rows": (_I, [_P, _P, _I64, _I64, _I64, _I64, _P, _P]),
    "glm5_hal_gpu_moe_unpermute": (_I, [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I, _P]),
}


def _i32(t: Tensor) -> Tensor:
    return t.to(torch.int32).contiguous()


class GpuKernelLibrary(SparseMlaDecodeLibrary):
    """The kernels of one toolchain's build. `label` names them in reasons ("MUSA kernel"),
    `target` is what the library must report (glm5_hal_gpu_target), `hint` says how to build."""
    signatures = SIGNATURES
    decode_limits = DecodeLimits("the sparse MLA kernel", max_dqk=MLA_MAX_DQK, max_d_v=MLA_MAX_DV, max_heads=65535)

    def __init__(self, path: Path, *, label: str, target: str, hint: str) -> None:
        super().__init__(path, label=label, hint=hint)
        self.target = target

    def validate(self, lib) -> str | None:
        target = lib.glm5_hal_gpu_target().decode()
        version = lib.glm5_hal_gpu_abi_version()
        if target != self.target or version != ABI_VERSION:
            return (f"{self.label} library {self.path.name} was built for {target} (ABI {version}), "
                    f"expected {self.target} (ABI {ABI_VERSION}); rebuild glm5_hal")
        return None

    # -- launchers (sparse_mla_decode_paged is SparseMlaDecodeLibrary's) ----------------------
    def indexer_topk(self, q: Tensor, keys: Tensor, key_scale: Tensor | None, weights: Tensor, k_start: Tensor,
                     k_end: Tensor, topk: int, stream: int, span: int | None = None) -> Tensor:
        """q [T, Hi, D], keys [S, D] (FP8 with key_scale [S]), weights [T, Hi], k_start/k_end [T]
        -> int32 [T, topk] key positions, -1 padded. `span` bounds every row's range (the
        workspace row length); None: the longest range, read from the device (one sync)."""
        tokens, heads, dim = q.shape
        out = torch.empty((tokens, topk), dtype=torch.int32, device=q.device)
        if tokens == 0:
            return out
        q, keys, weights = q.contiguous(), keys.contiguous(), weights.float().contiguous()
        scale = None if key_scale is None else key_scale.float().contiguous()
        start, end = _i32(k_start), _i32(k_end)
        if span is None:
            span = int((end - start).max())  # host sync: the workspace is sized exactly
        for first, last, workspace in self._row_chunks(tokens, span, q.device):
            self.launch("glm5_hal_gpu_indexer_topk", _ptr(q[first:last]), _ptr(keys), _ptr(scale),
                        _ptr(weights[first:last]), _ptr(start[first:last]), _ptr(end[first:last]),
                        _ptr(workspace), span, _ptr(out[first:last]), last - first, heads, dim, keys.shape[0],
                        topk, DTYPE_CODE[q.dtype], DTYPE_CODE[keys.dtype], stream)
        return out

    def indexer_topk_paged(self, q: Tensor, key_cache: Tensor, key_scale: Tensor | None, weights: Tensor,
                           block_table: Tensor, context_lens: Tensor, topk: int, stream: int,
                           span: int | None = None) -> Tensor:
        """q [B, N, Hi, D], key_cache [num_blocks, block_size, D] (FP8 with key_scale
        [num_blocks, block_size]), weights [B, N, Hi] -> int32 [B, N, topk] logical positions.
        `span` bounds every context length; None: the longest, read from the device (one sync)."""
        batch, queries, heads, dim = q.shape
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        out = torch.empty((batch, queries, topk), dtype=torch.int32, device=q.device)
        if out.numel() == 0:
            return out
        q, key_cache, weights = q.contiguous(), key_cache.contiguous(), weights.float().contiguous()
        scale = None if key_scale is None else key_scale.float().contiguous()
        table, lens = _i32(block_table), _i32(context_lens)
        if span is None:
            span = int(lens.max())  # host sync: the workspace is sized exactly
        # chunks of whole sequences: the kernel finds a row's sequence as row / N
        for first, last, workspace in self._row_chunks(batch, span * queries, q.device, per_row=queries):
            self.launch("glm5_hal_gpu_indexer_topk_paged", _ptr(q[first:last]), _ptr(key_cache), _ptr(scale),
                        _ptr(weights[first:last]), _ptr(table[first:last]), _ptr(lens[first:last]),
                        _ptr(workspace), span, _ptr(out[first:last]), last - first, queries, heads, dim,
                        num_blocks, block_size, table.shape[1], topk, DTYPE_CODE[q.dtype],
                        DTYPE_CODE[key_cache.dtype], stream)
        return out

    def kv_cache_write(self, cache: Tensor, values: Tensor, slot_mapping: Tensor, stream: int) -> None:
        """cache.view(-1, D)[slot] = values[t] for slot >= 0 (cache contiguous, written in place)."""
        if values.shape[0] == 0:
            return
        values = values.contiguous()
        slots = slot_mapping.contiguous()
        row_bytes = cache.shape[-1] * cache.element_size()
        self.launch("glm5_hal_gpu_kv_cache_write", _ptr(cache), _ptr(values), _ptr(slots),
                    int(slots.dtype == torch.int64), values.shape[0], row_bytes, cache.shape[0] * cache.shape[1],
                    stream)

    def silu_and_mul(self, x: Tensor, stream: int) -> Tensor:
        half = x.shape[-1] // 2
        out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        self.launch("glm5_hal_gpu_silu_and_mul", _ptr(rows), _ptr(out), rows.shape[0], half, DTYPE_CODE[x.dtype],
                    stream)
        return out

    def moe_permute(self, x: Tensor, ids: Tensor, num_experts: int, stream: int) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, D], ids int32 [T, k] -> (x_perm [M, D], tokens_per_expert int32 [E], src int32 [M])."""
        tokens, k = ids.shape
        counts = torch.empty(num_experts, dtype=torch.int32, device=x.device)
        src = torch.empty(tokens * k, dtype=torch.int32, device=x.device)
        ids = _i32(ids)
        self.launch("glm5_hal_gpu_moe_permute_index", _ptr(ids), tokens, k, num_experts, _ptr(counts), _ptr(src),
                    stream)
        rows = int(counts.sum())  # host sync: the output size depends on the data
        src = src[:rows].clone()
        x_perm = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
        if x_perm.numel():
            x = x.contiguous()
            self.launch("glm5_hal_gpu_gather_rows", _ptr(x), _ptr(src), rows, k, tokens,
                        x.shape[1] * x.element_size(), _ptr(x_perm), stream)
        return x_perm, counts, src

    def moe_unpermute(self, y: Tensor, src: Tensor, weights: Tensor, stream: int) -> Tensor:
        """y [M, D], src int32 [M], weights float32 [T, k] -> [T, D] like y."""
        tokens, k = weights.shape
        out = torch.empty((tokens, y.shape[1]), dtype=y.dtype, device=y.device)
        if out.numel() == 0:
            return out
        workspace = torch.empty((tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        y, src, weights = y.contiguous(), _i32(src), weights.float().contiguous()
        self.launch("glm5_hal_gpu_moe_unpermute", _ptr(y), _ptr(src), _ptr(weights), _ptr(workspace), _ptr(out),
                    y.shape[0], tokens, k, y.shape[1], DTYPE_CODE[y.dtype], stream)
        return out

    @staticmethod
    def _row_chunks(units: int, floats_per_unit: int, device: torch.device, per_row: int = 1):
        """(first, last, workspace) over [0, units) so that one workspace of float32 logits
        stays within WORKSPACE_BUDGET_BYTES (at least one unit per chunk)."""
        per_unit_bytes = max(floats_per_unit, 1) * 4
        step = max(1, WORKSPACE_BUDGET_BYTES // per_unit_bytes)
        for first in range(0, units, step):
            last = min(units, first + step)
            cols = floats_per_unit // per_row
            yield first, last, torch.empty(((last - first) * per_row, cols), dtype=torch.float32, device=device)

