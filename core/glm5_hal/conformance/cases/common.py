"""Cases for the elementwise / small ops (docs/ops/common.md)."""
from __future__ import annotations

import math

import torch

from ..case import RESULT, RESULT_OR_ERROR, Case, View, dtype_name, expected_errors, randn, uniform
from ..compare import Close
from ...presets import GLM5
from . import generator

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
GLM5_EPS = 1e-5    # rms_norm_eps of the GLM-5 config
GLM5_TOKENS = 5    # short sequences: real widths, few rows

# fp32 outputs only: for half outputs the final rounding dominates the accumulation error.
_WIDE_RMS = Close(widen=4, why="float32 sum of D >= 2048 squares: its rounding error grows ~sqrt(D)")


def _rms_norm_case(preset, name, dtype, rows, dim, *, wdtype=None, scale=1.0, zero_rows=(),
                   view=None, pad=0, note=""):
    """x: `rows + (dim,)` normal values times `scale`; weight in [0.5, 1.5).
    view: "transposed" | "strided" | "slice" makes x a non-contiguous view (`pad` extra
    columns for "slice")."""
    shape = (*rows, dim)

    def inputs(g):
        if view == "transposed":
            x = View(randn(g, (dim, *rows), dtype, scale), lambda b: b.movedim(0, -1))
        elif view == "strided":
            x = View(randn(g, (*rows, 2 * dim), dtype, scale), lambda b: b[..., ::2])
        elif view == "slice":
            x = View(randn(g, (*rows, dim + pad), dtype, scale), lambda b: b[..., :dim])
        else:
            x = randn(g, shape, dtype, scale)
            for r in zero_rows:
                x[r] = 0
        w = uniform(g, (dim,), wdtype or dtype, 0.5, 1.5)
        return x, w, GLM5_EPS

    rule = _WIDE_RMS if dtype == torch.float32 and dim >= 2048 else Close()
    return Case("rms_norm", preset, name, dtype, inputs, {"out": rule},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


_RMS_NORM_ERRORS = (
    ("weight_length_differs", lambda g, d: (randn(g, (3, 17), d), randn(g, (16,), d), GLM5_EPS),
     "weight", "weight [16] for x [3, 17]"),
    ("zero_width", lambda g, d: (randn(g, (3, 0), d), randn(g, (0,), d), GLM5_EPS),
     "x", "a last dim of 0 has no mean"),
    ("negative_eps", lambda g, d: (randn(g, (3, 17), d), randn(g, (17,), d), -1e-5),
     "eps", "eps < 0 could make mean(x^2) + eps negative"),
)


@generator("rms_norm")
def rms_norm_cases(preset: str):
    for dtype in FLOATS:
        if preset == "tiny":
            other = torch.float32 if dtype != torch.float32 else torch.bfloat16
            yield _rms_norm_case(preset, "rows1_dim1", dtype, (1,), 1)
            yield _rms_norm_case(preset, "rows3_dim17", dtype, (3,), 17)
            yield _rms_norm_case(preset, "rows17_dim129", dtype, (17,), 129)
            yield _rms_norm_case(preset, "rows129_dim64", dtype, (129,), 64)
            yield _rms_norm_case(preset, "batch2x3_dim33", dtype, (2, 3), 33, note="3-d input")
            yield _rms_norm_case(preset, f"weight_{dtype_name(other)}", dtype, (5,), 40, wdtype=other,
                                 note="weight dtype differs from x")
            yield _rms_norm_case(preset, "small_magnitude", dtype, (4,), 64, scale=3e-3,
                                 note="mean(x^2) ~ eps: eps must sit inside the rsqrt")
            yield _rms_norm_case(preset, "large_magnitude", dtype, (4,), 64, scale=300.0,
                                 note="x^2 overflows float16: squares must be summed in float32")
            yield _rms_norm_case(preset, "zero_rows", dtype, (3,), 17, zero_rows=(1,),
                                 note="an all-zero row normalises to zeros")
            yield _rms_norm_case(preset, "empty_batch", dtype, (0,), 17)
            yield _rms_norm_case(preset, "noncontig_transposed", dtype, (7,), 33, view="transposed")
            yield _rms_norm_case(preset, "noncontig_strided", dtype, (5,), 24, view="strided")
            yield _rms_norm_case(preset, "noncontig_row_slice", dtype, (6,), 40, view="slice", pad=5)
            yield from expected_errors("rms_norm", preset, dtype, _RMS_NORM_ERRORS)
        elif preset == "glm5":
            t = (GLM5_TOKENS,)
            yield _rms_norm_case(preset, "hidden6144", dtype, t, 6144,
                                 note="input/post-attention/final norms")
            yield _rms_norm_case(preset, "q_lora2048", dtype, t, 2048, note="q_a_layernorm")
            yield _rms_norm_case(preset, "kv_lora512", dtype, t, 512, note="kv_a_layernorm")
            yield _rms_norm_case(preset, "kv_lora512_of_576", dtype, t, 512, view="slice", pad=64,
                                 note="kv_a_layernorm on the c_kv slice of kv_a_proj_with_mqa's output")


# -- silu_and_mul ------------------------------------------------------------------------------
def _silu_and_mul_case(preset, name, dtype, rows, n, *, scale=1.0, view=None, note=""):
    """x: `rows + (2n,)` normal values times `scale` ([gate, up]).
    view: "transposed" | "strided" makes x a non-contiguous view."""
    shape = (*rows, 2 * n)

    def inputs(g):
        if view == "transposed":
            return (View(randn(g, (2 * n, *rows), dtype, scale), lambda b: b.movedim(0, -1)),)
        if view == "strided":
            return (View(randn(g, (*rows, 4 * n), dtype, scale), lambda b: b[..., ::2]),)
        return (randn(g, shape, dtype, scale),)

    return Case("silu_and_mul", preset, name, dtype, inputs, {"out": Close()},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


_SILU_AND_MUL_ERRORS = (
    ("odd_width", lambda g, d: (randn(g, (3, 35), d),), "x", "no [gate, up] halves in 35 columns"),
    ("zero_width", lambda g, d: (randn(g, (3, 0), d),), "x", "a last dim of 0 has no halves"),
    ("scalar_x", lambda g, d: (randn(g, (), d),), "x", "a 0-d x has no last dim"),
)


@generator("silu_and_mul")
def silu_and_mul_cases(preset: str):
    for dtype in FLOATS:
        if preset == "tiny":
            yield _silu_and_mul_case(preset, "rows1_n1", dtype, (1,), 1)
            yield _silu_and_mul_case(preset, "rows3_n17", dtype, (3,), 17)
            yield _silu_and_mul_case(preset, "rows17_n129", dtype, (17,), 129)
            yield _silu_and_mul_case(preset, "rows129_n64", dtype, (129,), 64)
            yield _silu_and_mul_case(preset, "batch2x3_n33", dtype, (2, 3), 33, note="3-d input")
            yield _silu_and_mul_case(preset, "saturating_gates", dtype, (5,), 40, scale=30.0,
                                     note="silu(g) ~ g for large g, ~ -0 for very negative g")
            yield _silu_and_mul_case(preset, "empty_batch", dtype, (0,), 17)
            yield _silu_and_mul_case(preset, "noncontig_transposed", dtype, (7,), 9, view="transposed")
            yield _silu_and_mul_case(preset, "noncontig_strided", dtype, (5,), 24, view="strided")
            yield from expected_errors("silu_and_mul", preset, dtype, _SILU_AND_MUL_ERRORS)
        elif preset == "glm5":
            yield _silu_and_mul_case(preset, "moe_rows40_n2048", dtype,
                                     (GLM5_TOKENS * GLM5.num_experts_per_tok,),
                                     GLM5.moe_intermediate_size,
                                     note="routed experts: T * 8 permuted rows of w13's output")
            yield _silu_and_mul_case(preset, "dense_n12288", dtype, (GLM5_TOKENS,),
                                     GLM5.intermediate_size, note="the first 3 dense MLP layers")


# -- apply_rope --------------------------------------------------------------------------------
MAX_POSITION = 202751   # max_position_embeddings 202752 - 1

_ROPE_SLACK_WHY = ("float32 angle pos*theta^(-2i/R): rounding of exponent (x ln theta), "
                   "inv_freq and product grows with the angle")


def rope_slack(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool
               ) -> torch.Tensor:
    """Per element: what computing the angle and the rotation in float32 may cost.

    The angle `pos * theta^e`, `e = -2i/R`, is off by a relative `(2 |e| ln(theta) + 4) * 2^-24`
    (the exponent's two roundings magnified by ln(theta), pow's ulp, the product's rounding,
    one to spare); an angle error d moves both elements of the pair by up to `d * |pair|`.
    Plus `4 * 2^-24 * |pair|` for cos, sin and the two products. At GLM-5's largest positions
    (~2e5) this is ~5% of |pair| for the fastest pair, and far tighter for the others."""
    r = x.shape[-1]
    e = torch.arange(r // 2, dtype=torch.float64) * (-2.0 / r)
    angle = positions.to("cpu", torch.float64)[:, None] * torch.pow(float(theta), e)[None, :]
    rel = (2 * e.abs() * abs(math.log(theta)) + 4) * 2.0 ** -24
    xf = x.to("cpu", torch.float64)
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    pair = torch.sqrt(a * a + b * b)
    per_pair = pair * (4 * 2.0 ** -24 + (rel * angle.abs())[:, None, :])
    return per_pair.repeat_interleave(2, dim=-1) if interleaved else torch.cat((per_pair, per_pair), -1)


_ROPE_RULE = Close(slack=rope_slack, why=_ROPE_SLACK_WHY)


def _rope_case(preset, name, dtype, tokens, heads, rot, *, positions=(0, 100), theta=GLM5.rope_theta,
               interleaved=True, pos_dtype=torch.int32, view=None, pad=0, note=""):
    """x [tokens, heads, rot] normal values; positions: a (low, high) range drawn uniformly,
    or an explicit list.
    view: "rope_tail" (x is the last `rot` dims of [T, H, pad + rot], the q_pe of a q head),
    "rope_head" (the first `rot` of [T, H, rot + pad], the indexer's rope dims),
    "row_tail" (x is [T, 1, rot] cut from the end of [T, pad + rot] rows, k_pe of the MLA
    projection), "row_head" (from the start of [T, rot + pad] rows, the indexer key),
    "heads_transposed" ([H, T, R] moved), "positions_strided" (positions a strided view)."""
    def make_positions(g):
        if isinstance(positions, tuple):
            low, high = positions
            return torch.randint(low, high + 1, (tokens,), generator=g, dtype=torch.int64).to(pos_dtype)
        return torch.tensor(positions, dtype=pos_dtype)

    def inputs(g):
        pos = make_positions(g)
        if view == "rope_tail":
            x = View(randn(g, (tokens, heads, pad + rot), dtype), lambda b: b[..., pad:])
        elif view == "rope_head":
            x = View(randn(g, (tokens, heads, rot + pad), dtype), lambda b: b[..., :rot])
        elif view == "row_tail":
            x = View(randn(g, (tokens, pad + rot), dtype), lambda b: b[:, None, pad:])
        elif view == "row_head":
            x = View(randn(g, (tokens, rot + pad), dtype), lambda b: b[:, None, :rot])
        elif view == "heads_transposed":
            x = View(randn(g, (heads, tokens, rot), dtype), lambda b: b.transpose(0, 1))
        else:
            x = randn(g, (tokens, heads, rot), dtype)
        if view == "positions_strided":
            spread = torch.stack((pos, torch.full_like(pos, -7)), dim=1).flatten()
            pos = View(spread, lambda b: b[::2])
        return x, pos, theta, interleaved

    return Case("apply_rope", preset, name, dtype, inputs, {"out": _ROPE_RULE},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


def _rope_positions(n: int, dtype=torch.int32) -> torch.Tensor:
    return torch.arange(n, dtype=dtype)


_ROPE_ERRORS = (
    ("odd_rotary_dim", lambda g, d: (randn(g, (3, 2, 17), d), _rope_positions(3), GLM5.rope_theta, True),
     "x", "R = 17 has no pairs"),
    ("positions_length_differs", lambda g, d: (randn(g, (3, 2, 16), d), _rope_positions(4), GLM5.rope_theta, True),
     "positions", "4 positions for 3 tokens"),
    ("float_positions", lambda g, d: (randn(g, (3, 2, 16), d), _rope_positions(3, torch.float32),
                                      GLM5.rope_theta, True), "positions", "positions are integers"),
    ("two_dim_x", lambda g, d: (randn(g, (3, 16), d), _rope_positions(3), GLM5.rope_theta, True),
     "x", "x is [T, H, R]"),
    ("zero_theta", lambda g, d: (randn(g, (3, 2, 16), d), _rope_positions(3), 0.0, True),
     "theta", "theta must be > 0"),
)


@generator("apply_rope")
def apply_rope_cases(preset: str):
    far = (MAX_POSITION - 4096, MAX_POSITION)
    for dtype in FLOATS:
        if preset == "tiny":
            yield _rope_case(preset, "t1_h1_r2", dtype, 1, 1, 2, positions=[5])
            yield _rope_case(preset, "t3_h17_r34", dtype, 3, 17, 34)
            yield _rope_case(preset, "t17_h3_r258", dtype, 17, 3, 258, positions=(0, 4096))
            yield _rope_case(preset, "t129_h1_r6", dtype, 129, 1, 6, positions=(0, MAX_POSITION),
                             note="positions across GLM-5's whole range")
            yield _rope_case(preset, "t3_h17_r34_half_split", dtype, 3, 17, 34, interleaved=False)
            yield _rope_case(preset, "t17_h3_r258_half_split", dtype, 17, 3, 258, positions=(0, 4096),
                             interleaved=False)
            yield _rope_case(preset, "position_zero", dtype, 3, 2, 16, positions=[0, 0, 0],
                             note="angle 0: the identity")
            yield _rope_case(preset, "negative_positions", dtype, 5, 3, 16, positions=(-300, 300),
                             note="rotate backwards (the op's own backward runs at -positions)")
            yield _rope_case(preset, "int64_positions", dtype, 4, 3, 18, pos_dtype=torch.int64,
                             positions=(0, 70000))
            yield _rope_case(preset, "theta1e4_half_split", dtype, 5, 4, 64, theta=1e4,
                             interleaved=False, note="DeepSeek-V3.2's indexer convention")
            yield _rope_case(preset, "max_positions", dtype, 7, 3, 64, positions=far,
                             note="GLM-5's largest positions: the float32 angle is ~1e-2 rad off")
            yield _rope_case(preset, "max_positions_half_split", dtype, 7, 3, 64, positions=far,
                             interleaved=False)
            yield _rope_case(preset, "empty_batch", dtype, 0, 3, 8)
            yield _rope_case(preset, "noncontig_rope_slice", dtype, 3, 5, 16, view="rope_tail", pad=12)
            yield _rope_case(preset, "noncontig_heads_transposed", dtype, 4, 3, 10,
                             view="heads_transposed")
            yield _rope_case(preset, "noncontig_positions", dtype, 6, 2, 8, view="positions_strided")
            yield from expected_errors("apply_rope", preset, dtype, _ROPE_ERRORS)
        elif preset == "glm5":
            t, heads, nope, rope = GLM5_TOKENS, GLM5.num_heads, GLM5.qk_nope_head_dim, GLM5.qk_rope_head_dim
            spread = [0, 4095, 65536, 131072, MAX_POSITION]
            yield _rope_case(preset, "q_pe_prefill", dtype, t, heads, rope, positions=list(range(t)),
                             note="q_pe [T, 64 heads, 64], the first tokens of a prompt")
            yield _rope_case(preset, "q_pe_decode_spread", dtype, t, heads, rope, positions=spread,
                             note="decode tokens of sequences up to max_position_embeddings")
            yield _rope_case(preset, "q_pe_of_q_heads", dtype, t, heads, rope, positions=spread,
                             view="rope_tail", pad=nope,
                             note="the rope slice q[..., 192:] of the [T, 64, 256] query heads")
            yield _rope_case(preset, "k_pe", dtype, t, 1, rope, positions=spread,
                             note="the shared rope key [T, 1, 64]")
            yield _rope_case(preset, "k_pe_of_kv_a_proj", dtype, t, 1, rope, positions=spread,
                             view="row_tail", pad=GLM5.kv_lora_rank,
                             note="k_pe as the last 64 of the 576-wide kv_a_proj_with_mqa rows")
            yield _rope_case(preset, "indexer_q", dtype, t, GLM5.index_n_heads, rope, positions=spread,
                             view="rope_head", pad=GLM5.index_head_dim - rope,
                             note="indexer queries: the first 64 of [T, 32, 128], interleaved")
            yield _rope_case(preset, "indexer_k", dtype, t, 1, rope, positions=spread,
                             view="row_head", pad=GLM5.index_head_dim - rope,
                             note="the indexer key: the first 64 of [T, 128]")


# -- hadamard_transform ------------------------------------------------------------------------
def _hadamard_case(preset, name, dtype, rows, dim, *, scale=None, fill=None, view=None, note=""):
    """x: `rows + (dim,)` normal values; scale defaults to dim^-0.5 (orthonormal).
    fill: "identity" (rows of I: the output rows are H's) or a constant for every element.
    view: "transposed" | "strided"."""
    scale = dim ** -0.5 if scale is None else scale
    shape = (*rows, dim)

    def inputs(g):
        if view == "transposed":
            x = View(randn(g, (dim, *rows), dtype), lambda b: b.movedim(0, -1))
        elif view == "strided":
            x = View(randn(g, (*rows, 2 * dim), dtype), lambda b: b[..., 1::2])
        elif fill == "identity":
            x = torch.eye(dim, dtype=dtype)
        elif fill is not None:
            x = torch.full(shape, fill, dtype=dtype)
        else:
            x = randn(g, shape, dtype)
        return x, scale

    return Case("hadamard_transform", preset, name, dtype, inputs, {"out": Close()},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


_HADAMARD_ERRORS = (
    ("dim24_not_a_power_of_two", lambda g, d: (randn(g, (3, 24), d), 24 ** -0.5),
     "x", "no Sylvester Hadamard matrix of order 24"),
    ("zero_width", lambda g, d: (randn(g, (3, 0), d), 1.0), "x", "D = 0 is no power of two"),
)


@generator("hadamard_transform")
def hadamard_transform_cases(preset: str):
    for dtype in FLOATS:
        if preset == "tiny":
            yield _hadamard_case(preset, "rows1_dim1", dtype, (1,), 1)
            yield _hadamard_case(preset, "rows3_dim2", dtype, (3,), 2)
            yield _hadamard_case(preset, "rows17_dim16", dtype, (17,), 16)
            yield _hadamard_case(preset, "rows129_dim128", dtype, (129,), 128)
            yield _hadamard_case(preset, "rows3_dim4096", dtype, (3,), 4096,
                                 note="12 butterfly stages: more than one tile")
            yield _hadamard_case(preset, "batch2x3_dim64", dtype, (2, 3), 64, note="3-d input")
            yield _hadamard_case(preset, "identity_dim32", dtype, (32,), 32, fill="identity",
                                 note="the rows of H_32 in Sylvester order, not sequency order")
            yield _hadamard_case(preset, "scale_one", dtype, (5,), 128, scale=1.0, note="unnormalised")
            yield _hadamard_case(preset, "negative_scale", dtype, (5,), 32, scale=-0.375)
            yield _hadamard_case(preset, "constant_rows_dim512", dtype, (2,), 512, fill=200.0,
                                 note="butterfly sums reach 512 * 200, beyond float16: sum in float32")
            yield _hadamard_case(preset, "empty_batch", dtype, (0,), 16)
            yield _hadamard_case(preset, "noncontig_transposed", dtype, (7,), 32, view="transposed")
            yield _hadamard_case(preset, "noncontig_strided", dtype, (5,), 64, view="strided")
            yield from expected_errors("hadamard_transform", preset, dtype, _HADAMARD_ERRORS)
        elif preset == "glm5":
            d = GLM5.index_head_dim
            yield _hadamard_case(preset, "indexer_q", dtype, (GLM5_TOKENS, GLM5.index_n_heads), d,
                                 note="indexer queries [T, 32, 128], scale 128^-0.5")
            yield _hadamard_case(preset, "indexer_k", dtype, (GLM5_TOKENS,), d,
                                 note="indexer keys [T, 128], scale 128^-0.5")
