"""The MoE ops on the cpu backend (docs/ops/moe.md). moe_route, moe_permute and moe_unpermute are
native kernels (csrc/moe.cpp); grouped_gemm is native for bfloat16 (csrc/qgemm.cpp) and calls
torch's GEMM for float16 and float32 (see it for why)."""
from __future__ import annotations

import torch

from glm5_hal.checks import expert_counts

from . import cpu
from .buffers import empty, outputs
from .native import _C, FLOATS, threads

_I32 = torch.int32


@cpu.impl("moe_permute", dtypes=FLOATS)
def moe_permute(x, ids, num_experts):
    tokens, k = ids.shape
    tokens_per_expert = torch.empty(num_experts, dtype=_I32)
    src = torch.empty(tokens * k, dtype=_I32)
    if k * x.nbytes < outputs.min_bytes:   # x_perm (at most T*k rows) is small: plan + gather in one call
        x_perm = _C.moe_permute(tokens_per_expert, src, x, ids, threads())
    else:   # the output's rows are known after the plan; its memory comes from the cache
        rows = _C.moe_permute_plan(tokens_per_expert, src, ids)
        x_perm = empty((rows, x.shape[1]), x.dtype)
        _C.moe_permute_gather(x_perm, x, src, k, threads())
    rows = x_perm.shape[0]
    return x_perm, tokens_per_expert, src if rows == tokens * k else src[:rows]


# validates_values: the kernel checks 0 <= src < T*k itself, before writing (csrc/moe.cpp).
@cpu.impl("moe_unpermute", dtypes=FLOATS, validates_values=True)
def moe_unpermute(y, src, weights, *, out=None):
    if out is None:
        out = empty((weights.shape[0], y.shape[1]), y.dtype)
    _C.moe_unpermute(out, y, src, weights, threads())
    return out


# validates_values: the bf16 kernel checks the counts itself (csrc/qgemm.cpp); the torch path
# checks them before slicing by them.
@cpu.impl("grouped_gemm", dtypes=FLOATS, validates_values=True)
def grouped_gemm(x, w, tokens_per_expert, *, out=None):
    if x.dtype == torch.bfloat16:  # the MoE layer's dtype: native tiles (AMX / AVX-512 BF16 / AVX2)
        if out is None:
            out = empty((x.shape[0], w.shape[1]), x.dtype)
        _C.bf16_grouped_gemm(out, x, w, tokens_per_expert, threads())
        return out
    # float16 / float32: torch's GEMMs (oneDNN/BLAS; float16 accumulates in float32 inside). What
    # is saved against the reference: no float32 copies of x and w, and each expert's product
    # lands in its slice of one output (no torch.cat).
    expert_counts("grouped_gemm", tokens_per_expert, x.shape[0], "x")
    return per_expert_mm(x, w, tokens_per_expert, out)


def per_expert_mm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """torch's GEMM once per expert, each product written into its slice of one output (`out`
    when given; the counts already checked). Also the bench's torch peer of the native bf16
    grouped GEMM."""
    if out is None:
        out = empty((x.shape[0], w.shape[1]), x.dtype)
    start = 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        if n:
            torch.mm(x[start:start + n], w[e].t(), out=out[start:start + n])
            start += n
    return out


@cpu.impl("moe_route", dtypes=FLOATS)
def moe_route(logits, bias, top_k, n_group=1, topk_group=1, routed_scaling_factor=1.0,
              norm_topk_prob=True, score_func="sigmoid"):
    tokens = logits.shape[0]
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=_I32)
    _C.moe_route(weights, ids, logits, bias, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
                 score_func == "softmax", threads())
    return weights, ids
