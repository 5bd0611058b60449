"""Cases for the MoE ops (docs/ops/moe.md): routing, permutation, unpermutation and the
grouped GEMM.

How each output is judged (docs/conformance.md, "MoE ops"):
- moe_route ids: `TopKSet` against the reference selection scores `c = s + bias`, masked
  to the kept groups; tau = twice the float32 bound (a swap moves two scores). Weights:
  `Close` in float32 against the reference's unbiased scores *of the ids the backend chose*,
  normalised and scaled (`Close(expect=...)`), so a legitimate swap is not a weight error.
- moe_permute: every output exact (the contract fixes the row order completely).
- moe_unpermute, grouped_gemm: `Close` in the activation dtype; float32 widened for the
  order-free fp32 reductions (top_k rows per token; K products per output).

Scales follow the model: router logits ~ N(0, 1.5^2) with a correction bias ~ U(-0.1, 0.1)
(large enough to change selections); expert weights ~ N(0, 1/K), so GEMM outputs are O(1).
"""
from __future__ import annotations

import dataclasses

import torch

from ... import reference as ref
from ...presets import DEEPSEEK_V32, GLM5
from ...reference.moe import NORM_EPS
from ..case import ERROR, RESULT, RESULT_OR_ERROR, Case, View, expected_errors, randn, uniform
from ..compare import Close, Exact, TopKSet
from ..tolerance import tolerance
from . import generator

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
I32 = torch.int32
E_GLM5 = GLM5.n_routed_experts           # 256
K_GLM5 = GLM5.num_experts_per_tok        # 8
HIDDEN = GLM5.hidden_size                # 6144
MOE_INTER = GLM5.moe_intermediate_size   # 2048
TOKENS_GLM5 = 5


# -- moe_route -------------------------------------------------------------------------------
def _unbiased_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    lf = logits.to("cpu", torch.float64)
    return torch.softmax(lf, dim=-1) if score_func == "softmax" else torch.sigmoid(lf)


def selection_scores(logits, bias, top_k, n_group, topk_group, scale, norm, score_func):
    """[T, E] the scores moe_route selects by (docs/ops/moe.md, steps 1-3): `c = s + bias`, `-inf`
    outside each token's `topk_group` best groups (group score: sum of its best two)."""
    c = _unbiased_scores(logits, score_func)
    if bias is not None:
        c = c + bias.to("cpu", torch.float64)
    if n_group > 1:
        tokens, experts = c.shape
        grouped = c.view(tokens, n_group, experts // n_group)
        group_scores = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(topk_group, dim=-1).indices, True)
        c = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return c


def weights_of_chosen_ids(ctx) -> torch.Tensor:
    """The weights the contract gives the ids the backend chose (docs/ops/moe.md, steps 5-7): their
    unbiased reference scores, normalised and scaled. NaN where an id is not an expert."""
    logits, bias, top_k, n_group, topk_group, scale, norm, score_func = ctx.reference_args
    ids = ctx.got("out[1]").long()
    s = _unbiased_scores(logits, score_func)
    experts = s.shape[1]
    known = (ids >= 0) & (ids < experts)
    w = s.gather(1, ids.clamp(0, max(experts - 1, 0)))
    w = torch.where(known, w, float("nan"))
    if norm:
        w = w / (w.sum(-1, keepdim=True) + NORM_EPS)
    return w * scale


ROUTE_IDS = TopKSet(scores=selection_scores, tau=tolerance(
    torch.float32, 2, "a within-tolerance swap moves two selection scores, each within the float32 bound"))
ROUTE_WEIGHTS = Close(dtype=torch.float32, widen=2, expect=weights_of_chosen_ids,
                      why="fp32 score function, a sum of top_k scores and a division, in any order")
ROUTE_CHECKS = {"out[0]": ROUTE_WEIGHTS, "out[1]": ROUTE_IDS}


@dataclasses.dataclass(frozen=True)
class RouteSpec:
    name: str
    tokens: int
    experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    scaling: float = GLM5.routed_scaling_factor
    norm: bool = True
    score_func: str = "sigmoid"
    bias: str = "float32"       # "float32" | "none" | "same" (the logits' dtype)
    logits: str = "normal"      # "normal" | "tied" (all equal) | "saturated" (|logit| >= 20)
    view: bool = False
    outcome: str = RESULT
    note: str = ""


def _route_args(g, spec: RouteSpec, dtype):
    t, e = spec.tokens, spec.experts
    if spec.logits == "tied":
        logits = torch.full((t, e), 0.75).to(dtype)
    elif spec.logits == "saturated":
        sign = torch.randint(0, 2, (t, e), generator=g) * 2 - 1
        logits = (sign * uniform(g, (t, e), torch.float32, 20.0, 40.0)).to(dtype)
    elif spec.view:
        logits = View(randn(g, (e, t), dtype, 1.5), lambda b: b.T)
    else:
        logits = randn(g, (t, e), dtype, 1.5)
    bias = None if spec.bias == "none" else uniform(
        g, (e,), dtype if spec.bias == "same" else torch.float32, -0.1, 0.1)
    return (logits, bias, spec.top_k, spec.n_group, spec.topk_group, spec.scaling, spec.norm,
            spec.score_func)


def _route_specs(preset: str) -> list[RouteSpec]:
    R = RouteSpec
    if preset == "tiny":
        return [
            R("t1_e1_top1", 1, 1, 1),
            R("t3_e17_top3", 3, 17, 3),
            R("t17_e129_top17", 17, 129, 17),
            R("grouped_e16_g4_tg2_top3", 17, 16, 3, n_group=4, topk_group=2),
            R("groups_of_one_e8_g8_tg3_top3", 3, 8, 3, n_group=8, topk_group=3,
              note="a one-expert group scores by its single expert"),
            R("no_bias", 3, 17, 3, bias="none"),
            R("bias_in_logits_dtype", 3, 17, 3, bias="same"),
            R("no_norm_scale1", 3, 17, 3, norm=False, scaling=1.0),
            R("softmax_no_norm", 3, 17, 3, score_func="softmax", norm=False, scaling=1.0),
            R("softmax_norm", 3, 17, 3, score_func="softmax"),
            R("tied_logits", 3, 17, 3, bias="none", logits="tied",
              note="every expert ties: any distinct choice, weights 1/top_k * scale"),
            R("saturated_logits", 3, 129, 8, logits="saturated",
              note="sigmoid rounds to 0 or 1 in float32: the bias decides among ties"),
            R("empty_batch", 0, 17, 3),
            R("noncontig_logits", 17, 33, 3, view=True, outcome=RESULT_OR_ERROR,
              note="logits a transposed view (expert-major storage)"),
        ]
    return [
        R("glm5_t5_e256_top8", TOKENS_GLM5, E_GLM5, K_GLM5,
          note="GLM-5: sigmoid + correction bias, n_group 1, routed_scaling_factor 2.5"),
        R("dsv32_t5_e256_g8_tg4_top8", TOKENS_GLM5, DEEPSEEK_V32.n_routed_experts,
          DEEPSEEK_V32.num_experts_per_tok, n_group=DEEPSEEK_V32.n_group,
          topk_group=DEEPSEEK_V32.topk_group, scaling=DEEPSEEK_V32.routed_scaling_factor,
          note="DeepSeek-V3.2 group-limited routing"),
    ]


@generator("moe_route")
def moe_route_cases(preset: str):
    for dtype in FLOATS:
        for spec in _route_specs(preset):
            yield Case("moe_route", preset, spec.name, dtype,
                       lambda g, spec=spec, dtype=dtype: _route_args(g, spec, dtype),
                       ROUTE_CHECKS, outcome=spec.outcome, note=spec.note)
        if preset == "tiny":
            for spec in (RouteSpec("n_group_not_dividing", 3, 17, 3, n_group=4, topk_group=2,
                                   note="E % n_group != 0"),
                         RouteSpec("top_k_beyond_kept_groups", 3, 16, 9, n_group=4, topk_group=2,
                                   note="top_k > topk_group * E / n_group")):
                yield Case("moe_route", preset, spec.name, dtype,
                           lambda g, spec=spec, dtype=dtype: _route_args(g, spec, dtype),
                           outcome=ERROR, note=spec.note)


# -- routing tables shared by permute / unpermute / grouped_gemm -------------------------------
def routed_ids(g, tokens: int, k: int, experts: int) -> torch.Tensor:
    """[T, k] int32: k distinct experts per token, uniformly drawn."""
    if tokens == 0:
        return torch.zeros(0, k, dtype=I32)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(I32)


@dataclasses.dataclass(frozen=True)
class PermuteSpec:
    """ids: "routed" (k distinct of `id_range` per token; ids >= num_experts are another
    rank's) or an explicit table."""
    name: str
    tokens: int
    k: int
    experts: int
    dim: int
    ids: str | tuple = "routed"
    id_range: int = 0          # routed ids drawn from [0, id_range) (default: experts)
    view: bool = False
    outcome: str = RESULT
    note: str = ""


def _ids(g, spec) -> torch.Tensor:
    if spec.ids == "routed":
        return routed_ids(g, spec.tokens, spec.k, spec.id_range or spec.experts)
    return torch.tensor(spec.ids, dtype=I32).reshape(spec.tokens, spec.k)


def _permute_args(g, spec: PermuteSpec, dtype):
    ids = _ids(g, spec)
    if spec.view:
        x = View(randn(g, (spec.tokens, spec.dim + 7), dtype), lambda b, d=spec.dim: b[:, :d])
        ids = View(torch.cat([ids, torch.full_like(ids, -1)], dim=1), lambda b, k=spec.k: b[:, :k])
        return x, ids, spec.experts
    return randn(g, (spec.tokens, spec.dim), dtype), ids, spec.experts


def _permute_specs(preset: str) -> list[PermuteSpec]:
    P = PermuteSpec
    if preset == "tiny":
        return [
            P("t1_k1_e1_d1", 1, 1, 1, 1),
            P("t3_k3_e17_d17", 3, 3, 17, 17),
            P("t17_k3_e129_d33", 17, 3, 129, 33, note="most experts get zero rows"),
            P("t129_k1_e3_d17", 129, 1, 3, 17, note="~43 rows per expert: the stable order matters"),
            P("crowded_expert", 17, 3, 5, 17, ids=tuple([2, 0, 4] * 17),
              note="every token sends slot 0 to expert 2"),
            P("duplicate_expert_in_row", 3, 3, 5, 17, ids=(1, 1, 3, 4, 0, 4, 2, 2, 2),
              note="a token naming an expert twice gets two rows, by flat index"),
            P("dropped_ids", 4, 3, 5, 17, ids=(-1, 3, 5, 0, 7, -1, 3, 3, 100, -1, -1, -1),
              note="-1 and ids >= num_experts (another rank's) are dropped"),
            P("other_rank_ids", 17, 3, 8, 17, id_range=32,
              note="rank 0 of 4: ids drawn from 32 experts, only 0..7 are local"),
            P("all_dropped", 3, 2, 4, 17, ids=(-1, 4, 9, -1, -1, 5), note="M = 0"),
            P("empty_batch", 0, 3, 5, 17),
            P("noncontig_views", 17, 3, 5, 33, view=True, outcome=RESULT_OR_ERROR,
              note="x (column slice) and ids (column slice) are views"),
        ]
    return [
        P("hidden6144_t5_top8_e256", TOKENS_GLM5, K_GLM5, E_GLM5, HIDDEN,
          note="40 rows over 256 experts: most get zero rows"),
        P("hidden6144_ep_rank_of8", 16, K_GLM5, E_GLM5 // 8, HIDDEN, id_range=E_GLM5,
          note="expert parallelism over 8 ranks: 32 local experts, other ranks' ids dropped"),
    ]


PERMUTE_CHECKS = {"out[0]": Exact(), "out[1]": Exact(), "out[2]": Exact()}


_PERMUTE_ERRORS = (
    ("id_rows_differ", lambda g, d: (randn(g, (3, 17), d), routed_ids(g, 4, 2, 5), 5),
     "ids", "ids for 4 tokens, x of 3"),
    ("int64_ids", lambda g, d: (randn(g, (3, 17), d), routed_ids(g, 3, 2, 5).long(), 5), "ids", "ids are int32"),
    ("zero_slots", lambda g, d: (randn(g, (3, 17), d), torch.zeros(3, 0, dtype=I32), 5),
     "ids", "ids [T, 0]: no slot per token"),
    ("three_dim_x", lambda g, d: (randn(g, (3, 1, 17), d), routed_ids(g, 3, 2, 5), 5), "x", "x is [T, D]"),
    ("zero_experts", lambda g, d: (randn(g, (3, 17), d), routed_ids(g, 3, 2, 5), 0), "num_experts", "num_experts >= 1"),
)


@generator("moe_permute")
def moe_permute_cases(preset: str):
    for dtype in FLOATS:
        for spec in _permute_specs(preset):
            yield Case("moe_permute", preset, spec.name, dtype,
                       lambda g, spec=spec, dtype=dtype: _permute_args(g, spec, dtype),
                       PERMUTE_CHECKS, outcome=spec.outcome, note=spec.note)
        if preset == "tiny":
            yield from expected_errors("moe_permute", preset, dtype, _PERMUTE_ERRORS)


# -- moe_unpermute ---------------------------------------------------------------------------
UNPERMUTE_FP32 = Close(widen=2, why="fp32 sum of up to top_k weighted rows per token, in any order")


def routing_weights(g, tokens: int, k: int) -> torch.Tensor:
    """[T, k] float32 positive weights, normalised and scaled as moe_route's."""
    w = uniform(g, (tokens, k), torch.float32, 0.05, 1.0)
    return w / w.sum(-1, keepdim=True) * GLM5.routed_scaling_factor


@dataclasses.dataclass(frozen=True)
class UnpermuteSpec:
    """src: "routed" (moe_permute's src for routed ids, `experts` of them local), or an
    explicit list of flat indices."""
    name: str
    tokens: int
    k: int
    dim: int
    experts: int = 8
    id_range: int = 0
    src: str | tuple = "routed"
    zero_weights: bool = False
    view: bool = False
    outcome: str = RESULT
    note: str = ""


def _unpermute_args(g, spec: UnpermuteSpec, dtype):
    if spec.src == "routed":
        ids = routed_ids(g, spec.tokens, spec.k, spec.id_range or spec.experts)
        src = ref.moe_permute(torch.zeros(spec.tokens, 1), ids, spec.experts)[2]
    else:
        src = torch.tensor(spec.src, dtype=I32)
    rows = src.shape[0]
    weights = routing_weights(g, spec.tokens, spec.k)
    if spec.zero_weights:
        weights[:, ::2] = 0
    if spec.view:
        y = View(randn(g, (2 * rows, spec.dim), dtype), lambda b: b[::2])
        weights = View(weights.T.contiguous(), lambda b: b.T)
        return y, src, weights
    return randn(g, (rows, spec.dim), dtype), src, weights


def _unpermute_specs(preset: str) -> list[UnpermuteSpec]:
    U = UnpermuteSpec
    if preset == "tiny":
        return [
            U("t1_k1_d1", 1, 1, 1, experts=1),
            U("t3_k3_d17", 3, 3, 17, experts=5),
            U("t17_k8_d129", 17, 8, 129, experts=33),
            U("unrouted_tokens", 5, 3, 17, src=(0, 2, 1, 12, 13, 14, 7),
              note="tokens 1 and 3 have no rows: zeros"),
            U("other_rank_rows", 17, 3, 33, experts=4, id_range=16,
              note="expert parallelism: only the local experts' rows come back"),
            U("duplicate_src", 3, 2, 17, src=(0, 0, 3, 5, 3), note="a row per occurrence, each summed"),
            U("zero_weights", 3, 3, 17, experts=5, zero_weights=True),
            U("no_rows", 3, 3, 17, src=(), note="M = 0: all zeros"),
            U("empty_batch", 0, 3, 17, src=()),
            U("noncontig_views", 17, 3, 33, experts=5, view=True, outcome=RESULT_OR_ERROR,
              note="y (every other row) and weights (transposed) are views"),
        ]
    return [
        U("hidden6144_t5_top8", TOKENS_GLM5, K_GLM5, HIDDEN, experts=E_GLM5),
        U("hidden6144_ep_rank_of8", 16, K_GLM5, HIDDEN, experts=E_GLM5 // 8, id_range=E_GLM5,
          note="expert parallelism: only this rank's rows; many tokens get zeros"),
    ]


@generator("moe_unpermute")
def moe_unpermute_cases(preset: str):
    for dtype in FLOATS:
        checks = {"out": UNPERMUTE_FP32 if dtype == torch.float32 else Close()}
        for spec in _unpermute_specs(preset):
            yield Case("moe_unpermute", preset, spec.name, dtype,
                       lambda g, spec=spec, dtype=dtype: _unpermute_args(g, spec, dtype),
                       checks, outcome=spec.outcome, note=spec.note)
        if preset == "tiny":
            for name, src, note in (("src_out_of_range", (0, 9, 4), "src = T*k"),
                                    ("negative_src", (0, -1, 4), "src = -1")):
                spec = UnpermuteSpec(name, 3, 3, 17, src=src)
                yield Case("moe_unpermute", preset, name, dtype,
                           lambda g, spec=spec, dtype=dtype: _unpermute_args(g, spec, dtype),
                           outcome=ERROR, note=note)


# -- grouped_gemm ----------------------------------------------------------------------------
GEMM_FP32 = Close(widen=4, why="fp32 sum of K products per output in any order (blocking, split-K)")


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """counts: rows per expert, or ("routed", tokens, k) for moe_permute's counts of routed ids."""
    name: str
    counts: tuple
    n: int
    k: int
    experts: int = 0           # with routed counts
    view: str = ""             # "" | "x_slice" | "w_transposed"
    outcome: str = RESULT
    note: str = ""


def _gemm_args(g, spec: GemmSpec, dtype):
    if spec.counts and spec.counts[0] == "routed":
        _, tokens, top = spec.counts
        counts = ref.moe_permute(torch.zeros(tokens, 1), routed_ids(g, tokens, top, spec.experts),
                                 spec.experts)[1]
    else:
        counts = torch.tensor(spec.counts, dtype=I32)
    experts, rows = counts.shape[0], max(int(counts.sum()), 0)
    wscale = max(spec.k, 1) ** -0.5
    if spec.view == "x_slice":
        x = View(randn(g, (rows, spec.k + 9), dtype), lambda b, k=spec.k: b[:, :k])
    else:
        x = randn(g, (rows, spec.k), dtype)
    if spec.view == "w_transposed":
        w = View(randn(g, (experts, spec.k, spec.n), dtype, wscale), lambda b: b.transpose(1, 2))
    else:
        w = randn(g, (experts, spec.n, spec.k), dtype, wscale)
    return x, w, counts


def _gemm_specs(preset: str) -> list[GemmSpec]:
    G = GemmSpec
    if preset == "tiny":
        return [
            G("e1_m1_n1_k1", (1,), 1, 1),
            G("e3_m17_n17_k33", (5, 0, 12), 17, 33),
            G("e17_m129_n3_k129", (0, 9, 0, 0, 30, 1, 0, 17, 0, 0, 40, 0, 2, 0, 0, 30, 0), 3, 129,
              note="zero-row experts between and around busy ones"),
            G("zero_row_ends", (0, 3, 0, 0, 4, 0), 17, 33, note="the first and last experts have no rows"),
            G("one_busy_expert", (0, 0, 17, 0), 17, 33),
            G("routed_e33_t17_top3", ("routed", 17, 3), 17, 33, experts=33),
            G("empty_batch", (0, 0, 0), 17, 33, note="M = 0"),
            G("no_experts", (), 17, 33, note="E = 0, M = 0"),
            G("noncontig_x", (5, 0, 12), 17, 33, view="x_slice", outcome=RESULT_OR_ERROR),
            G("noncontig_w", (5, 0, 12), 17, 33, view="w_transposed", outcome=RESULT_OR_ERROR,
              note="w stored [E, K, N] and viewed as [E, N, K]"),
        ]
    # A float64 reference of all 256 experts at [2*2048, 6144] would hold 51 GB of weights:
    # the real GEMM shapes run with a few experts, and the real expert count with N cut to 16.
    return [
        G("w13_e2_n4096_k6144", (3, 5), 2 * MOE_INTER, HIDDEN,
          note="gate/up projection at the real shape, two experts"),
        G("w2_e3_n6144_k2048", (4, 0, 4), HIDDEN, MOE_INTER,
          note="down projection at the real shape, the middle expert without rows"),
        G("routed_e256_t4_top8_n16_k2048", ("routed", 4, K_GLM5), 16, MOE_INTER, experts=E_GLM5,
          note="all 256 experts, counts of a real top-8 routing (>= 224 zero-row experts); N cut to 16"),
    ]


@generator("grouped_gemm")
def grouped_gemm_cases(preset: str):
    for dtype in FLOATS:
        checks = {"out": GEMM_FP32 if dtype == torch.float32 else Close()}
        for spec in _gemm_specs(preset):
            yield Case("grouped_gemm", preset, spec.name, dtype,
                       lambda g, spec=spec, dtype=dtype: _gemm_args(g, spec, dtype),
                       checks, outcome=spec.outcome, note=spec.note)
        if preset == "tiny":
            for name, counts, rows, note in (("counts_sum_below_rows", (5, 0, 11), 17, "sum 16 < M = 17"),
                                             ("counts_sum_above_rows", (5, 1, 12), 17, "sum 18 > M = 17"),
                                             ("negative_count", (6, -1, 12), 17, "a count < 0")):
                def inputs(g, counts=counts, rows=rows, dtype=dtype):
                    x, w, _ = _gemm_args(g, GemmSpec("x", (rows, 0, 0), 17, 33), dtype)
                    return x, w, torch.tensor(counts, dtype=I32)
                yield Case("grouped_gemm", preset, name, dtype, inputs, outcome=ERROR, note=note)
