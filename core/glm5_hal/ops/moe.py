"""MoE ops (docs/ops/moe.md): routing, token permutation, grouped GEMM.

A GLM-5 MoE layer is `moe_route -> moe_permute -> grouped_gemm(w13) -> silu_and_mul ->
grouped_gemm(w2) -> moe_unpermute` (plus the shared expert).
"""
from __future__ import annotations

import torch

from .. import checks as C
from .. import reference as ref
from ..checks import FLOAT_DTYPES as FLOAT, INDEX_DTYPES as INDEX
from ..contract import Bool, Choice, Int, Let, Number, Out, Rule, Tensor
from ..opdef import define, defined_in

SCORE_FUNCS = ("sigmoid", "softmax")


def _fake_moe_route(logits, bias, top_k, *rest):
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32))


moe_route = define(
    ref.moe_route,
    args=dict(logits=Tensor("T, E", FLOAT), bias=Tensor("E", FLOAT, optional=True),
              n_group=Int(min=1), topk_group=Int(min=1), top_k=Int(min=1),
              routed_scaling_factor=Number(), norm_topk_prob=Bool(), score_func=Choice(SCORE_FUNCS)),
    rules=[Rule("logits", "E >= 1", "at least one expert (shape [T, E] with E >= 1)"),
           Rule("n_group", "E % n_group == 0", "a divisor of the expert count {E}"),
           Rule("topk_group", "topk_group <= n_group", "an int in [1, n_group={n_group}]"),
           Let("selectable", "topk_group * (E // n_group)"),
           Rule("top_k", "top_k <= selectable",
                "an int in [1, {selectable}] (topk_group * experts per group)")],
    fake=_fake_moe_route,
    doc="""Picks `top_k` experts per token and their weights (DeepSeek-V3 / GLM-5 routing).

    logits:     [T, E] bfloat16 | float16 | float32, router logits
    bias:       [E] float or None, the score correction bias; it steers *selection* only
    top_k:      experts per token, 1 <= top_k <= topk_group * E / n_group
    n_group:    contiguous expert groups (E % n_group == 0); 1 disables group limiting
    topk_group: groups kept per token, 1 <= topk_group <= n_group; a group's score is the
                sum of its best two biased scores (its best one if a group has one expert)
    routed_scaling_factor: finite float multiplying the final weights
    norm_topk_prob: divide the selected weights by their sum (+ 1e-20)
    score_func: "sigmoid" (GLM-5, DeepSeek-V3) or "softmax" over the E logits
    returns (weights float32 [T, top_k], ids int32 [T, top_k]); weights are the *unbiased*
        scores of the chosen experts, normalised and scaled.
    """)


def _fake_moe_permute(x, ids, num_experts):
    rows = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty(rows, x.shape[1]), ids.new_empty(num_experts, dtype=torch.int32),
            ids.new_empty(rows, dtype=torch.int32))


moe_permute = define(
    ref.moe_permute,
    args=dict(x=Tensor("T, D", FLOAT), ids=Tensor("T, k", INDEX), num_experts=Int(min=1)),
    rules=[Rule("ids", "k >= 1", "shape [T, k] with k >= 1")],
    fake=_fake_moe_permute,
    differentiable=True,
    doc="""Gathers one row of `x` per valid (token, slot) pair, grouped by expert.

    x:           [T, D] bfloat16 | float16 | float32
    ids:         [T, k] int32 expert ids (k >= 1); ids outside [0, num_experts) (-1, experts
                 of another rank) are dropped
    num_experts: int >= 1
    returns (x_perm [M, D] like x, tokens_per_expert int32 [num_experts], src int32 [M]):
        M = number of valid ids; rows grouped by expert ascending and, within an expert,
        by ascending flat index t*k + j; src[r] is that flat index (token src[r] // k).
        M is data-dependent (an unbacked size under torch.compile).
    Differentiable with respect to x.
    """)


def _check_moe_unpermute_values(y, src, weights):
    tokens, k = weights.shape
    C.index_range("moe_unpermute", "src", src, 0, tokens * k)


moe_unpermute = define(
    ref.moe_unpermute,
    args=dict(y=Tensor("M, D", FLOAT), src=Tensor("M", INDEX), weights=Tensor("T, k", (torch.float32,))),
    rules=[Rule("weights", "k >= 1", "shape [T, k] with k >= 1")],
    check_values=_check_moe_unpermute_values,
    fake=lambda y, src, weights: y.new_empty(weights.shape[0], y.shape[1]),
    out=Out("T, D", dtype="y"),
    differentiable=True,
    doc="""Scatters expert outputs back to their tokens, weighted by the routing weights.

    y:       [M, D] bfloat16 | float16 | float32, expert outputs in moe_permute's row order
    src:     [M] int32, flat (token, slot) index of each row, 0 <= src < T*k
    weights: [T, k] float32 routing weights (moe_route's first output)
    returns [T, D] like y: out[t] = sum over rows r with src[r] // k == t of
        weights[t, src[r] % k] * y[r], accumulated in float32; tokens without rows get 0.
    out:     optional [T, D] buffer of y's dtype, written and returned (docs/ops.md, "out= buffers").
    Differentiable with respect to y and weights.
    """)


def _check_grouped_gemm_values(x, w, tokens_per_expert):
    C.expert_counts("grouped_gemm", tokens_per_expert, x.shape[0], "x")


grouped_gemm = define(
    ref.grouped_gemm,
    args=dict(x=Tensor("M, K", FLOAT), w=Tensor("E, N, K", "x"), tokens_per_expert=Tensor("E", INDEX)),
    check_values=_check_grouped_gemm_values,
    fake=lambda x, w, tokens_per_expert: x.new_empty(x.shape[0], w.shape[1]),
    out=Out("M, N", dtype="x"),
    differentiable=True,
    doc="""One GEMM per expert over its contiguous rows of x (moe_permute's layout).

    x:                 [M, K] bfloat16 | float16 | float32
    w:                 [E, N, K] same dtype as x (expert e's weight is w[e], used as w[e]^T)
    tokens_per_expert: [E] int32, counts >= 0 summing to M; zero-row experts are fine
    returns [M, N] like x: y[rows_e] = x[rows_e] @ w[e]^T, accumulated in float32.
    out:               optional [M, N] buffer of x's dtype, written and returned (docs/ops.md, "out= buffers").
    Differentiable with respect to x and w.
    """)

__all__ = defined_in(__name__)
