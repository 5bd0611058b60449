"""A stand-in for a kernel library implementing glm5_hal_sparse_mla_decode_paged (the
interface every glm5_hal kernel library with that kernel shares: core/glm5_hal/include/
glm5_hal_kernel_abi.h), so the Python side -- adapter, launcher, argument struct -- runs end
to end where nothing compiles the BANG C or XPU kernels.

It takes the place of the C entry point only: the real launcher of
glm5_hal.vendor_ops.dsa allocates the outputs, makes the inputs contiguous int32 / dtype
tensors and packs the glm5_hal_sparse_mla_decode_args struct; `launch()` here then reads the
tensors back from the struct's addresses (host memory in tests), computes the contract in
plain torch (not glm5_hal.reference) and writes out and lse where the kernel would.
"""
from __future__ import annotations

import ctypes
import math

import torch

from glm5_hal.backends.cambricon.kernels import KernelLibrary
from glm5_hal.kernel_library import DTYPE_CODE
from glm5_hal.vendor_ops.dsa import SPARSE_MLA_DECODE

_DTYPES = {code: dtype for dtype, code in DTYPE_CODE.items()}


def tensor_at(address: int | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The contiguous tensor of `shape` and `dtype` at a host address (a view: writes land there)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    size = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype, count=count).view(shape)


class SparseDecodeKernelStandIn(KernelLibrary):
    """The cambricon kernel library (its limits, its launcher) with a torch body behind the
    entry point; `launches` counts the calls that reached it."""

    def __init__(self) -> None:
        super().__init__(path="stand-in")
        self.launches = 0

    def missing(self) -> None:
        return None

    def status(self) -> str:
        return "stand-in (tests)"

    def launch(self, name: str, args_ref, stream) -> None:
        assert name == SPARSE_MLA_DECODE and isinstance(stream, int)
        a = args_ref._obj  # the glm5_hal_sparse_mla_decode_args passed by reference
        dtype = _DTYPES[a.dtype]
        lead = (a.batch, a.queries_per_seq)
        q = tensor_at(a.q, (*lead, a.heads, a.dqk), dtype)
        kv_cache = tensor_at(a.kv_cache, (a.num_blocks, a.block_size, a.dqk), dtype)
        block_table = tensor_at(a.block_table, (a.batch, a.max_blocks), torch.int32)
        context_lens = tensor_at(a.context_lens, (a.batch,), torch.int32)
        indices = tensor_at(a.indices, (*lead, a.topk), torch.int32)
        out = tensor_at(a.out, (*lead, a.heads, a.d_v), dtype)
        lse = tensor_at(a.lse, (*lead, a.heads), torch.float32)
        self.launches += 1
        for b in range(a.batch):
            length = int(context_lens[b])
            for i in range(a.queries_per_seq):
                picks = [int(p) for p in indices[b, i].tolist() if 0 <= int(p) < length]
                if not picks:
                    out[b, i] = 0
                    lse[b, i] = -math.inf
                    continue
                pos = torch.tensor(picks)
                rows = kv_cache[block_table[b, pos // a.block_size].long(), pos % a.block_size].float()
                z = (q[b, i].float() @ rows.T) * a.sm_scale                                # [heads, n]
                m = z.max(dim=-1, keepdim=True).values
                p = torch.exp(z - m)
                total = p.sum(dim=-1, keepdim=True)
                out[b, i] = ((p / total) @ rows[:, :a.d_v]).to(out.dtype)
                lse[b, i] = (m + torch.log(total)).squeeze(-1)
