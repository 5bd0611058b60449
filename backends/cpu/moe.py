"""The MoE ops on the cpu backend (OPS.md section 5). moe_permute and moe_unpermute are native
kernels (csrc/moe.cpp); moe_route and grouped_gemm call torch (see each for why)."""
from __future__ import annotations

import torch

from glm5_hal.reference.moe import NORM_EPS

from . import cpu
from .ops import _C, DTYPE_CODE, FLOATS, _threads

_I32 = torch.int32


@cpu.impl("moe_permute", dtypes=FLOATS)
def moe_permute(x, ids, num_experts):
    tokens, k = ids.shape
    if ids.stride(1) != 1:
        ids = ids.contiguous()
    tokens_per_expert = torch.empty(num_experts, dtype=_I32)
    src = torch.empty(tokens * k, dtype=_I32)
    # Two native calls: the plan's row count M sizes the output before the gather fills it.
    rows = _C.moe_permute_plan(tokens_per_expert.data_ptr(), src.data_ptr(), ids.data_ptr(),
                               tokens, k, ids.stride(0), num_experts)
    dim = x.shape[1]
    if dim > 1 and x.stride(1) != 1:
        x = x.contiguous()
    es = x.element_size()
    x_perm = torch.empty((rows, dim), dtype=x.dtype)
    _C.moe_permute_gather(x_perm.data_ptr(), x.data_ptr(), tokens, dim * es, x.stride(0) * es,
                          src.data_ptr(), rows, k, _threads())
    return x_perm, tokens_per_expert, src if rows == tokens * k else src[:rows]


# validates_values: the kernel checks 0 <= src < T*k itself, before writing (csrc/moe.cpp).
@cpu.impl("moe_unpermute", dtypes=FLOATS, validates_values=True)
def moe_unpermute(y, src, weights):
    tokens, k = weights.shape
    rows, dim = y.shape
    if dim > 1 and y.stride(1) != 1:
        y = y.contiguous()
    if not src.is_contiguous():
        src = src.contiguous()
    if not weights.is_contiguous():
        weights = weights.contiguous()
    out = torch.empty((tokens, dim), dtype=y.dtype)
    _C.moe_unpermute(out.data_ptr(), y.data_ptr(), rows, dim, y.stride(0), src.data_ptr(),
                     weights.data_ptr(), tokens, k, DTYPE_CODE[y.dtype], _threads())
    return out


@cpu.impl("grouped_gemm", dtypes=FLOATS)
def grouped_gemm(x, w, tokens_per_expert):
    # torch (oneDNN/BLAS) GEMMs are the best CPU GEMMs at hand; bf16/fp16 accumulate in fp32
    # inside them. What is saved against the reference: no fp32 copies of x and w, and each
    # expert's product lands in its slice of one output (no torch.cat).
    out = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype)
    start = 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        if n:
            torch.mm(x[start:start + n], w[e].t(), out=out[start:start + n])
            start += n
    return out


@cpu.impl("moe_route", dtypes=FLOATS)
def moe_route(logits, bias, top_k, n_group=1, topk_group=1, routed_scaling_factor=1.0,
              norm_topk_prob=True, score_func="sigmoid"):
    # torch: a sigmoid and a top-k over E = 256 per token are torch's vectorised kernels
    # already; this differs from the reference only by skipping work GLM-5 does not need
    # (group limiting when n_group == 1) and by working in place.
    lf = logits.float()
    scores = torch.softmax(lf, dim=-1) if score_func == "softmax" else torch.sigmoid(lf)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + NORM_EPS
    if routed_scaling_factor != 1.0:
        weights *= routed_scaling_factor
    return weights, ids.to(_I32)
