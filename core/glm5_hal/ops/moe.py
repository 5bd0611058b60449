"""MoE ops (OPS.md section 5): routing, token permutation, grouped GEMM.

A GLM-5 MoE layer is `moe_route -> moe_permute -> grouped_gemm(w13) -> silu_and_mul ->
grouped_gemm(w2) -> moe_unpermute` (plus the shared expert).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import checks as C
from .. import reference as ref
from ..registry import OpDef, define

__all__ = ["moe_route", "moe_permute", "moe_unpermute", "grouped_gemm"]

SCORE_FUNCS = ("sigmoid", "softmax")


# -- moe_route --------------------------------------------------------------------------------
def _check_moe_route(logits, bias, top_k, n_group, topk_group, routed_scaling_factor,
                     norm_topk_prob, score_func):
    op = "moe_route"
    C.tensor(op, "logits", logits, ndim=2, dtypes=C.FLOAT_DTYPES)
    E = logits.shape[1]
    if E < 1:
        C.fail(op, "logits", "at least one expert (shape [T, E] with E >= 1)", f"shape {list(logits.shape)}")
    if bias is not None:
        C.tensor(op, "bias", bias, ndim=1, dtypes=C.FLOAT_DTYPES)
        C.shape(op, "bias", bias, [E])
        C.same_device(op, "logits", logits, bias=bias)
    C.integer(op, "n_group", n_group, min_value=1)
    if E % n_group != 0:
        C.fail(op, "n_group", f"a divisor of the expert count {E}", n_group)
    C.integer(op, "topk_group", topk_group, min_value=1)
    if topk_group > n_group:
        C.fail(op, "topk_group", f"an int in [1, n_group={n_group}]", topk_group)
    C.integer(op, "top_k", top_k, min_value=1)
    selectable = topk_group * (E // n_group)
    if top_k > selectable:
        C.fail(op, "top_k", f"an int in [1, {selectable}] (topk_group * experts per group)", top_k)
    C.number(op, "routed_scaling_factor", routed_scaling_factor)
    if not isinstance(norm_topk_prob, bool):
        C.fail(op, "norm_topk_prob", "a bool", repr(norm_topk_prob))
    C.choice(op, "score_func", score_func, SCORE_FUNCS)


def _fake_moe_route(logits, bias, top_k, *rest):
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32))


_MOE_ROUTE = define(OpDef(
    name="moe_route",
    schema=("(Tensor logits, Tensor? bias, int top_k, int n_group, int topk_group, "
            "float routed_scaling_factor, bool norm_topk_prob, "
            "str score_func) -> (Tensor, Tensor)"),
    reference=ref.moe_route,
    check=_check_moe_route,
    fake=_fake_moe_route,
    dispatch_arg="logits",
))


def moe_route(logits: Tensor, bias: Tensor | None, top_k: int, n_group: int = 1,
              topk_group: int = 1, routed_scaling_factor: float = 1.0,
              norm_topk_prob: bool = True, score_func: str = "sigmoid") -> tuple[Tensor, Tensor]:
    """Picks `top_k` experts per token and their weights (DeepSeek-V3 / GLM-5 routing).

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
    """
    return _MOE_ROUTE(logits, bias, top_k, n_group, topk_group, routed_scaling_factor,
                      norm_topk_prob, score_func)


# -- moe_permute ------------------------------------------------------------------------------
def _check_moe_permute(x, ids, num_experts):
    op = "moe_permute"
    C.tensor(op, "x", x, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(op, "ids", ids, ndim=2, dtypes=C.INDEX_DTYPES)
    C.shape(op, "ids", ids, [x.shape[0], None])
    if ids.shape[1] < 1:
        C.fail(op, "ids", "shape [T, k] with k >= 1", f"shape {list(ids.shape)}")
    C.same_device(op, "x", x, ids=ids)
    C.integer(op, "num_experts", num_experts, min_value=1)


def _fake_moe_permute(x, ids, num_experts):
    rows = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty(rows, x.shape[1]), ids.new_empty(num_experts, dtype=torch.int32),
            ids.new_empty(rows, dtype=torch.int32))


_MOE_PERMUTE = define(OpDef(
    name="moe_permute",
    schema="(Tensor x, Tensor ids, int num_experts) -> (Tensor, Tensor, Tensor)",
    reference=ref.moe_permute,
    check=_check_moe_permute,
    fake=_fake_moe_permute,
    dispatch_arg="x",
    differentiable=True,
))


def moe_permute(x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gathers one row of `x` per valid (token, slot) pair, grouped by expert.

    x:           [T, D] bfloat16 | float16 | float32
    ids:         [T, k] int32 expert ids (k >= 1); ids outside [0, num_experts) (-1, experts
                 of another rank) are dropped
    num_experts: int >= 1
    returns (x_perm [M, D] like x, tokens_per_expert int32 [num_experts], src int32 [M]):
        M = number of valid ids; rows grouped by expert ascending and, within an expert,
        by ascending flat index t*k + j; src[r] is that flat index (token src[r] // k).
        M is data-dependent (an unbacked size under torch.compile).
    Differentiable with respect to x.
    """
    return _MOE_PERMUTE(x, ids, num_experts)


# -- moe_unpermute ----------------------------------------------------------------------------
def _check_moe_unpermute(y, src, weights):
    op = "moe_unpermute"
    C.tensor(op, "y", y, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(op, "src", src, ndim=1, dtypes=C.INDEX_DTYPES)
    C.shape(op, "src", src, [y.shape[0]])
    C.tensor(op, "weights", weights, ndim=2, dtypes=(torch.float32,))
    if weights.shape[1] < 1:
        C.fail(op, "weights", "shape [T, k] with k >= 1", f"shape {list(weights.shape)}")
    C.same_device(op, "y", y, src=src, weights=weights)


def _check_moe_unpermute_values(y, src, weights):
    C.index_range("moe_unpermute", "src", src, 0, weights.shape[0] * weights.shape[1])


_MOE_UNPERMUTE = define(OpDef(
    name="moe_unpermute",
    schema="(Tensor y, Tensor src, Tensor weights) -> Tensor",
    reference=ref.moe_unpermute,
    check=_check_moe_unpermute,
    check_values=_check_moe_unpermute_values,
    fake=lambda y, src, weights: y.new_empty(weights.shape[0], y.shape[1]),
    dispatch_arg="y",
    differentiable=True,
))


def moe_unpermute(y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    """Scatters expert outputs back to their tokens, weighted by the routing weights.

    y:       [M, D] bfloat16 | float16 | float32, expert outputs in moe_permute's row order
    src:     [M] int32, flat (token, slot) index of each row, 0 <= src < T*k
    weights: [T, k] float32 routing weights (moe_route's first output)
    returns [T, D] like y: out[t] = sum over rows r with src[r] // k == t of
        weights[t, src[r] % k] * y[r], accumulated in float32; tokens without rows get 0.
    Differentiable with respect to y and weights.
    """
    return _MOE_UNPERMUTE(y, src, weights)


# -- grouped_gemm -----------------------------------------------------------------------------
def _check_grouped_gemm(x, w, tokens_per_expert):
    op = "grouped_gemm"
    C.tensor(op, "x", x, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(op, "w", w, ndim=3, dtypes=C.FLOAT_DTYPES)
    C.same_dtype(op, "x", x, "w", w)
    C.shape(op, "w", w, [None, None, x.shape[1]])
    C.tensor(op, "tokens_per_expert", tokens_per_expert, ndim=1, dtypes=C.INDEX_DTYPES)
    C.shape(op, "tokens_per_expert", tokens_per_expert, [w.shape[0]])
    C.same_device(op, "x", x, w=w, tokens_per_expert=tokens_per_expert)


def _check_grouped_gemm_values(x, w, tokens_per_expert):
    op = "grouped_gemm"
    if tokens_per_expert.numel() == 0:
        if x.shape[0] != 0:
            C.fail(op, "tokens_per_expert", f"counts summing to {x.shape[0]} (the rows of 'x')",
                   "no experts")
        return
    negative = (tokens_per_expert < 0).nonzero()
    if negative.numel():
        e = int(negative[0, 0])
        C.fail(op, "tokens_per_expert", "counts >= 0", f"{int(tokens_per_expert[e])} for expert {e}")
    total = int(tokens_per_expert.sum())
    if total != x.shape[0]:
        C.fail(op, "tokens_per_expert", f"counts summing to {x.shape[0]} (the rows of 'x')",
               f"sum {total}")


_GROUPED_GEMM = define(OpDef(
    name="grouped_gemm",
    schema="(Tensor x, Tensor w, Tensor tokens_per_expert) -> Tensor",
    reference=ref.grouped_gemm,
    check=_check_grouped_gemm,
    check_values=_check_grouped_gemm_values,
    fake=lambda x, w, tokens_per_expert: x.new_empty(x.shape[0], w.shape[1]),
    dispatch_arg="x",
    differentiable=True,
))


def grouped_gemm(x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """One GEMM per expert over its contiguous rows of x (moe_permute's layout).

    x:                 [M, K] bfloat16 | float16 | float32
    w:                 [E, N, K] same dtype as x (expert e's weight is w[e], used as w[e]^T)
    tokens_per_expert: [E] int32, counts >= 0 summing to M; zero-row experts are fine
    returns [M, N] like x: y[rows_e] = x[rows_e] @ w[e]^T, accumulated in float32.
    Differentiable with respect to x and w.
    """
    return _GROUPED_GEMM(x, w, tokens_per_expert)
