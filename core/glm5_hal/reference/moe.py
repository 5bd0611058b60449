"""Reference implementations of the MoE ops (docs/ops/moe.md).

Plain torch on any device. Scores and accumulations run in float32, or in float64 when the
inputs are float64 (the conformance suite feeds upcast inputs).
"""
from __future__ import annotations

import torch

from .common import compute_dtype

__all__ = ["moe_route", "moe_permute", "moe_unpermute", "grouped_gemm"]

# Added to the sum of the selected weights before normalising, so a row whose selected
# scores all underflow to 0 yields zeros instead of NaN (DeepSeek-V3 / GLM-5 inference code).
NORM_EPS = 1e-20


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int = 1,
              topk_group: int = 1, routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
              score_func: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    ct = compute_dtype(logits.dtype)
    lf = logits.to(ct)
    scores = torch.softmax(lf, dim=-1) if score_func == "softmax" else torch.sigmoid(lf)
    choice = scores if bias is None else scores + bias.to(ct)
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def moe_permute(x: torch.Tensor, ids: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    valid_flat = ((flat >= 0) & (flat < num_experts)).nonzero().squeeze(1)  # ascending
    experts = flat[valid_flat]
    # A stable sort by expert keeps ascending flat index within each expert.
    order = torch.sort(experts, stable=True).indices
    src = valid_flat[order]
    tokens_per_expert = torch.bincount(experts, minlength=num_experts)
    return x[src // k], tokens_per_expert.to(torch.int32), src.to(torch.int32)


def moe_unpermute(y: torch.Tensor, src: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    ct = compute_dtype(y.dtype)
    T, k = weights.shape
    src64 = src.long()
    weighted = y.to(ct) * weights.to(ct).reshape(-1)[src64].unsqueeze(1)
    # Rows land in their (t, j) slot first, then each token sums its k slots in j order:
    # with the usual one row per (t, j) the summation order is fixed, so the result does
    # not depend on atomics (index_add into [T, D] directly would on CUDA).
    slots = torch.zeros(T * k, y.shape[1], dtype=ct, device=y.device).index_add(0, src64, weighted)
    return slots.view(T, k, y.shape[1]).sum(dim=1).to(y.dtype)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    # One matmul per expert: E (<= 256) is small next to the token count, and a per-row
    # gather of w (bmm over [M, N, K]) would need M*N*K memory at real sizes.
    counts = tokens_per_expert.tolist()
    outs = [rows.to(ct) @ w[e].to(ct).T for e, rows in enumerate(x.split(counts))]
    if not outs:
        return x.new_zeros(x.shape[0], w.shape[1])
    return torch.cat(outs).to(x.dtype)
