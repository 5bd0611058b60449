"""The MoE ops on the cpu backend (OPS.md section 5). moe_route, moe_permute and moe_unpermute are
native kernels (csrc/moe.cpp); grouped_gemm is native for bfloat16 (csrc/qgemm.cpp) and calls
torch's GEMM for float16 and float32 (see it for why)."""
from __future__ import annotations

import torch

from . import cpu, quant_gemm
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
    if x.dtype == torch.bfloat16:  # the MoE layer's dtype: native tiles (AMX / AVX-512 BF16 / AVX2)
        return quant_gemm.grouped(quant_gemm.BF16_KIND, x, None, w, None, tokens_per_expert, x.dtype)
    # float16 / float32: torch's GEMMs (oneDNN/BLAS; float16 accumulates in float32 inside). What
    # is saved against the reference: no float32 copies of x and w, and each expert's product
    # lands in its slice of one output (no torch.cat).
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
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=_I32)
    _C.moe_route(weights.data_ptr(), ids.data_ptr(), logits.data_ptr(), DTYPE_CODE[logits.dtype], tokens, experts,
                 logits.stride(0), 0 if bias is None else bias.data_ptr(),
                 0 if bias is None else DTYPE_CODE[bias.dtype], top_k, n_group, topk_group,
                 routed_scaling_factor, norm_topk_prob, score_func == "softmax", _threads())
    return weights, ids
