"""Cases for the quantization ops (docs/ops/quant.md).

FP8 outputs are judged as codes (`Fp8Codes`: round to nearest even, either neighbour only
within float32 noise of a midpoint) next to their scales; packed INT4 bit for bit with its
scales. The scales are one float32 division of an input element (amax / 448, amax / 7):
INT4 scales must match exactly (the packed weight is a storage format that must reproduce
across machines, and every code depends on its scale); plain FP8 scales within the float32
base tolerance (a division evaluated through a reciprocal may be an ulp off; each side's
codes are judged against its own scale); ue8m0 scales exactly (a power of two: any
deviation is a factor of 2).
"""
from __future__ import annotations

import dataclasses

import torch

from ... import reference as ref
from ..case import ERROR, RESULT, RESULT_OR_ERROR, Case, View, randn, uniform
from ..compare import Close, Exact
from ..transforms import Fp8Codes
from ...presets import GLM5
from . import generator

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SCALE_FMTS = (None, "ue8m0")
GLM5_TOKENS = 5
GLM5_GROUP = 128   # INT4 weight groups and FP8 activation blocks
NIBBLES = 8

_FP8_VALUES = Exact(transform=Fp8Codes("out[1]", source="x"))
_SCALES = {None: Close(dtype=torch.float32), "ue8m0": Exact(dtype=torch.float32)}


def _fmt_name(scale_fmt: str | None) -> str:
    return "ue8m0" if scale_fmt == "ue8m0" else "fp32scale"


# Values on which e4m3 rounding is decided by the tie rule, for a block whose amax is 448
# (scale exactly 1, in both scale formats): each is the midpoint of two e4m3 neighbours and
# must go to the even one. Several round *away* from zero (so truncation fails), others
# toward it (so rounding half away from zero fails); a few sit in the subnormal range and
# at the subnormal/normal and binade boundaries. Exact in float32, float16 and bfloat16.
FP8_TIES = (448.0, 1.0625, 1.1875, -1.1875, 19.0, -19.0, 2 ** -10, 3 * 2 ** -10,
            -3 * 2 ** -10, 5 * 2 ** -10, 2 ** -6 + 2 ** -10, 232.0, 248.0, -248.0, 440.0, -1.0625)


def _fp8_case(preset, name, dtype, shape, block, scale_fmt, *, scale=1.0, fill=None, view=None,
              note=""):
    """x: `shape` normal values times `scale`.
    fill: "ties" (rows of FP8_TIES times 1, 2^-3, 4 and -1: scales stay powers of two),
    "zero_blocks" (every other block all zero), "below_floor" (|x| < 1e-4: the amax floor),
    "wide_range" (one large element per block, the rest ~1e-5 of it: subnormal codes).
    view: "transposed" | "strided" | "slice" (the first K of wider rows)."""
    k = shape[-1]

    def inputs(g):
        if view == "transposed":
            x = View(randn(g, (k, *shape[:-1]), dtype, scale), lambda b: b.movedim(0, -1))
        elif view == "strided":
            x = View(randn(g, (*shape[:-1], 2 * k), dtype, scale), lambda b: b[..., ::2])
        elif view == "slice":
            x = View(randn(g, (*shape[:-1], k + 64), dtype, scale), lambda b: b[..., :k])
        elif fill == "ties":
            base = torch.tensor(FP8_TIES)
            x = torch.stack([base, base * 2 ** -3, base * 4, -base]).to(dtype)
        else:
            x = randn(g, shape, dtype, scale).float()
            blocks = x.view(*shape[:-1], k // block, block)
            if fill == "zero_blocks":
                blocks[..., ::2, :] = 0
            elif fill == "below_floor":
                x = x * 2e-5
            elif fill == "wide_range":
                blocks *= 5e-4
                blocks[..., 0] = 30.0
            x = x.to(dtype)
        return x, block, scale_fmt

    fmt = _fmt_name(scale_fmt)
    return Case("fp8_block_quant", preset, f"{name}_{fmt}", dtype, inputs,
                {"out[0]": _FP8_VALUES, "out[1]": _SCALES[scale_fmt]},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


@generator("fp8_block_quant")
def fp8_block_quant_cases(preset: str):
    for dtype in FLOATS:
        for fmt in SCALE_FMTS:
            if preset == "tiny":
                yield _fp8_case(preset, "rows1_k1_block1", dtype, (1, 1), 1, fmt,
                                note="a block of one: the element is its own amax")
                yield _fp8_case(preset, "rows3_k17_block17", dtype, (3, 17), 17, fmt)
                yield _fp8_case(preset, "rows17_k387_block129", dtype, (17, 387), 129, fmt)
                yield _fp8_case(preset, "rows129_k256_block128", dtype, (129, 256), 128, fmt)
                yield _fp8_case(preset, "batch2x3_k48_block16", dtype, (2, 3, 48), 16, fmt,
                                note="3-d input")
                yield _fp8_case(preset, "rounding_ties", dtype, (4, 16), 16, fmt, fill="ties",
                                note="exact e4m3 midpoints must round to even")
                yield _fp8_case(preset, "zero_blocks", dtype, (3, 128), 32, fmt, fill="zero_blocks",
                                note="all-zero blocks: amax floor 1e-4, codes 0")
                yield _fp8_case(preset, "below_floor", dtype, (3, 64), 32, fmt, fill="below_floor",
                                note="|x| < 1e-4: the scale is the floor's, codes stay below 448")
                yield _fp8_case(preset, "wide_range", dtype, (3, 64), 16, fmt, fill="wide_range",
                                note="small elements of a block with a large amax: subnormal codes, "
                                     "no flush to zero")
                yield _fp8_case(preset, "large_magnitude", dtype, (3, 64), 32, fmt, scale=8000.0,
                                note="amax near the float16 limit")
                yield _fp8_case(preset, "empty_batch", dtype, (0, 128), 128, fmt)
                yield _fp8_case(preset, "noncontig_transposed", dtype, (5, 32), 16, fmt, view="transposed")
                yield _fp8_case(preset, "noncontig_strided", dtype, (3, 64), 32, fmt, view="strided")
            elif preset == "glm5":
                t, block = GLM5_TOKENS, GLM5_GROUP
                yield _fp8_case(preset, "hidden6144", dtype, (t, GLM5.hidden_size), block, fmt,
                                note="activations [T, 6144] before an FP8 GEMM, blocks of 128")
                yield _fp8_case(preset, "indexer_q", dtype, (t, GLM5.index_n_heads, GLM5.index_head_dim),
                                GLM5.index_head_dim, fmt, note="indexer queries, one block per head")
                yield _fp8_case(preset, "indexer_k", dtype, (t, GLM5.index_head_dim),
                                GLM5.index_head_dim, fmt, note="indexer key rows [T, 128]")
                yield _fp8_case(preset, "hidden6144_of_wider_rows", dtype, (t, GLM5.hidden_size), block,
                                fmt, view="slice", note="a row slice (stride > K)")
        if preset == "tiny":
            yield Case("fp8_block_quant", preset, "block_not_dividing_k", dtype,
                       lambda g, dtype=dtype: (randn(g, (2, 130), dtype), 128, None), outcome=ERROR,
                       note="K = 130 is not a multiple of the block 128")


# -- INT4 --------------------------------------------------------------------------------------
# A group whose amax is 7 has scale exactly 1 (times 2^k when scaled by 2^k): the halves below
# are exact ties of round(w / s) and must go to the even integer.
INT4_TIES = (7.0, 0.5, 1.5, 2.5, -2.5, 3.5, -3.5, 4.5, 5.5, 6.5, -6.5, -0.5, 0.0, 1.0, -7.0, 2.0)


def _weight(g, n, k, group, dtype, fill, scale=0.02):
    """w [n, k] normal values times `scale` (a weight's magnitude).
    fill: "ties" (rows of INT4_TIES times 1, 2^-4, 8 and -1), "zero_groups" (every other group
    zero: the scale floor), "below_floor" (amax < 7e-5: floor 1e-5 applies before dividing),
    "negative_amax" (each group's largest magnitude is negative)."""
    if fill == "ties":
        base = torch.tensor(INT4_TIES)
        return torch.stack([base, base * 2 ** -4, base * 8, -base]).repeat(1, k // 16)[:n].to(dtype)
    w = randn(g, (n, k), torch.float32, scale)
    groups = w.view(n, k // group, group)
    if fill == "zero_groups":
        groups[:, ::2] = 0
    elif fill == "below_floor":
        w = w * 5e-4
    elif fill == "negative_amax":
        groups[..., 0] = -groups.abs().amax(-1) * 1.5
    return w.to(dtype)


def _int4_weight_case(op, preset, name, dtype, n, k, group, checks, *, fill=None, view=None, note=""):
    def inputs(g):
        if view == "transposed":
            w = View(_weight(g, k, n, 1, dtype, None), lambda b: b.t())
        else:
            w = _weight(g, n, k, group, dtype, fill)
        return w, group

    return Case(op, preset, name, dtype, inputs, checks,
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


def _int4_weight_cases(op: str, preset: str, checks: dict, glm5_shape: tuple[int, int], note: str):
    """The shared INT4 weight cases of int4_fake_quant and int4_pack."""
    for dtype in FLOATS:
        case = lambda *a, **kw: _int4_weight_case(op, preset, *a, checks=checks, **kw)
        if preset == "tiny":
            yield case("n1_k8_g1", dtype, 1, 8, 1, note="groups of one: every element is +-7 * s")
            yield case("n3_k24_g8", dtype, 3, 24, 8)
            yield case("n17_k136_g17", dtype, 17, 136, 17, note="groups straddle the int32 words")
            yield case("n129_k64_g64", dtype, 129, 64, 64)
            yield case("rounding_ties", dtype, 4, 32, 16, fill="ties",
                       note="exact halves of round(w / s) go to the even integer")
            yield case("zero_groups", dtype, 3, 64, 16, fill="zero_groups", note="the scale floor 1e-5")
            yield case("below_floor", dtype, 3, 64, 32, fill="below_floor",
                       note="amax / 7 below the floor: s = 1e-5, codes stay within +-7")
            yield case("negative_amax", dtype, 5, 32, 16, fill="negative_amax", note="q = -7, never -8")
            yield case("empty_rows", dtype, 0, 64, 32)
            yield case("noncontig_transposed", dtype, 24, 40, 8, view="transposed",
                       note="a weight stored [K, N], passed transposed")
            yield Case(op, preset, "group_not_dividing_k", dtype,
                       lambda g, dtype=dtype: (randn(g, (2, 48), dtype), 32), outcome=ERROR,
                       note="group 32 does not divide K = 48")
        elif preset == "glm5":
            n, k = glm5_shape
            yield case(f"n{n}_k{k}_g{GLM5_GROUP}", dtype, n, k, GLM5_GROUP, note=note)


@generator("int4_fake_quant")
def int4_fake_quant_cases(preset: str):
    yield from _int4_weight_cases(
        "int4_fake_quant", preset, {"out": Close()},
        (GLM5.moe_intermediate_size, GLM5.hidden_size),
        "an expert's gate/up projection (also q_a_proj's shape)")


@generator("int4_pack")
def int4_pack_cases(preset: str):
    yield from _int4_weight_cases(
        "int4_pack", preset, {"out[0]": Exact(), "out[1]": Exact(dtype=torch.float32)},
        (GLM5.hidden_size, GLM5.moe_intermediate_size), "an expert's down projection")
    if preset == "tiny":
        yield Case("int4_pack", preset, "k_not_multiple_of_8", torch.float32,
                   lambda g: (randn(g, (2, 12), torch.float32), 4), outcome=ERROR,
                   note="K = 12 does not fill whole int32 words")


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """int32 words [N, K/8] from nibbles [N, K] in 0..15: element 8j + i in bits 4i..4i+3."""
    n, k = nibbles.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (nibbles.to(torch.int64).reshape(n, k // NIBBLES, NIBBLES) << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _packed_weight(g, n, k, group, *, all_nibbles=False):
    """A packed INT4 weight [n, k] and its scales: codes in -7..7 as int4_pack makes them (or
    every nibble 0..15 with `all_nibbles`: unpack accepts any word), scales of a weight with
    magnitude ~0.02."""
    low = 0 if all_nibbles else 1
    nibbles = torch.randint(low, 16, (n, k), generator=g)
    scale = uniform(g, (n, k // group), torch.float32, 0.002, 0.02)
    return pack_nibbles(nibbles), scale


def _unpack_case(preset, name, n, k, group, *, all_nibbles=False, zero_scale=False, view=None,
                 note=""):
    def inputs(g):
        packed, scale = _packed_weight(g, n, k, group, all_nibbles=all_nibbles)
        if zero_scale:
            scale[:, ::2] = 0
        if view == "packed_slice":
            wide = torch.cat((packed, packed.flip(1)), dim=1)
            packed = View(wide, lambda b, w=k // NIBBLES: b[:, :w])
        elif view == "scale_transposed":
            scale = View(scale.t().contiguous(), lambda b: b.t())
        return packed, scale, group

    return Case("int4_unpack", preset, name, torch.int32, inputs, {"out": Exact(dtype=torch.float32)},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


@generator("int4_unpack")
def int4_unpack_cases(preset: str):
    if preset == "tiny":
        yield _unpack_case(preset, "n1_k8_g8", 1, 8, 8)
        yield _unpack_case(preset, "n3_k24_g8", 3, 24, 8)
        yield _unpack_case(preset, "n17_k136_g17", 17, 136, 17, note="groups straddle the int32 words")
        yield _unpack_case(preset, "n129_k64_g32", 129, 64, 32)
        yield _unpack_case(preset, "all_nibbles", 9, 64, 16, all_nibbles=True,
                           note="any word decodes: nibble 0 is -8 * s, bit 31 makes words negative")
        yield _unpack_case(preset, "zero_scales", 3, 64, 16, zero_scale=True)
        yield _unpack_case(preset, "empty_rows", 0, 64, 32)
        yield _unpack_case(preset, "noncontig_packed", 5, 48, 16, view="packed_slice")
        yield _unpack_case(preset, "noncontig_scale", 5, 64, 16, view="scale_transposed")
        yield Case("int4_unpack", preset, "group_not_dividing_k", torch.int32,
                   lambda g: (*_packed_weight(g, 2, 48, 16), 32), outcome=ERROR,
                   note="group 32 does not divide K = 48")
    elif preset == "glm5":
        for n, k in ((GLM5.moe_intermediate_size, GLM5.hidden_size),
                     (GLM5.hidden_size, GLM5.moe_intermediate_size)):
            yield _unpack_case(preset, f"n{n}_k{k}_g{GLM5_GROUP}", n, k, GLM5_GROUP)


# fp32 outputs only: for half outputs the final rounding dominates the accumulation error.
_WIDE_GEMM = Close(widen=8, why="float32 dot products of K >= 2048 terms in any summation order: "
                                "rounding error grows ~sqrt(K)")


def _gemm_case(preset, name, dtype, m, n, k, group, *, view=None, note=""):
    def inputs(g):
        packed, scale = _packed_weight(g, n, k, group)
        if view == "x_transposed":
            x = View(randn(g, (k, m), dtype), lambda b: b.t())
        else:
            x = randn(g, (m, k), dtype)
        if view == "packed_slice":
            spread = torch.stack((packed, packed.flip(0)), dim=1).flatten(0, 1)
            packed = View(spread, lambda b: b[::2])
        return x, packed, scale, group

    rule = _WIDE_GEMM if dtype == torch.float32 and k >= 2048 else Close()
    return Case("w4a16_gemm", preset, name, dtype, inputs, {"out": rule},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


@generator("w4a16_gemm")
def w4a16_gemm_cases(preset: str):
    for dtype in FLOATS:
        if preset == "tiny":
            yield _gemm_case(preset, "m1_n1_k8_g8", dtype, 1, 1, 8, 8)
            yield _gemm_case(preset, "m3_n17_k24_g8", dtype, 3, 17, 24, 8)
            yield _gemm_case(preset, "m17_n3_k136_g17", dtype, 17, 3, 136, 17)
            yield _gemm_case(preset, "m5_n129_k256_g128", dtype, 5, 129, 256, 128)
            yield _gemm_case(preset, "m129_n33_k64_g32", dtype, 129, 33, 64, 32)
            yield _gemm_case(preset, "empty_m", dtype, 0, 17, 64, 32)
            yield _gemm_case(preset, "empty_n", dtype, 3, 0, 64, 32)
            yield _gemm_case(preset, "noncontig_x", dtype, 5, 9, 64, 16, view="x_transposed")
            yield _gemm_case(preset, "noncontig_packed", dtype, 3, 7, 64, 16, view="packed_slice")
            yield Case("w4a16_gemm", preset, "group_not_dividing_k", dtype,
                       lambda g, dtype=dtype: (randn(g, (2, 48), dtype), *_packed_weight(g, 3, 48, 16), 32),
                       outcome=ERROR, note="group 32 does not divide K = 48")
        elif preset == "glm5":
            t = GLM5_TOKENS
            yield _gemm_case(preset, "gate_up_n2048_k6144", dtype, t, GLM5.moe_intermediate_size,
                             GLM5.hidden_size, GLM5_GROUP, note="an expert's gate (or up) projection")
            yield _gemm_case(preset, "down_n6144_k2048", dtype, t, GLM5.hidden_size,
                             GLM5.moe_intermediate_size, GLM5_GROUP, note="an expert's down projection")


# -- GEMMs on the checkpoint formats (docs/ops/quant.md) ---------------------------------------
# How each output is judged (docs/conformance.md, "Common, quant and kv ops"):
# - fp8_block_gemm, fp8_grouped_gemm: `Close` in the output dtype. Products of e4m3 values are
#   exact in float32; what differs between correct implementations is the float32 sum of K
#   products (per-block partial sums times their scales), hence a widening for float32
#   outputs; half outputs keep the base tolerance (their own rounding dominates).
# - int8_gemm, int8_grouped_gemm: `Close` at the base tolerance, never widened: the integer
#   sum is exact, only the float32 roundings of the int32 sum and of the scaling remain
#   (<= 4 float32 ulps, the base rtol is ~22).
# - int8_quant: codes `Exact` through `Int8Codes` (round half to even; either neighbour only
#   within float32 noise of a midpoint), scales `Close(float32)` like fp8_block_quant's.
FP8 = torch.float8_e4m3fn
I8 = torch.int8
I32 = torch.int32
GEMM_BLOCK = 128
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_NAMES = {torch.bfloat16: "bf16out", torch.float16: "fp16out", torch.float32: "fp32out"}
# GLM-5's linear layers (docs/models.md) as (N, K): the attention projections and an
# expert's fused gate/up (w13) and down (w2) projections.
Q_A = (GLM5.q_lora_rank, GLM5.hidden_size)                                          # 2048 x 6144
KV_A = (GLM5.kv_lora_rank + GLM5.qk_rope_head_dim, GLM5.hidden_size)                # 576 x 6144
Q_B = (GLM5.num_heads * GLM5.qk_head_dim, GLM5.q_lora_rank)                         # 16384 x 2048
KV_B = (GLM5.num_heads * (GLM5.qk_nope_head_dim + GLM5.v_head_dim), GLM5.kv_lora_rank)  # 28672 x 512
O_PROJ = (GLM5.hidden_size, GLM5.num_heads * GLM5.v_head_dim)                       # 6144 x 16384
W13 = (2 * GLM5.moe_intermediate_size, GLM5.hidden_size)                           # 4096 x 6144
W2 = (GLM5.hidden_size, GLM5.moe_intermediate_size)                                # 6144 x 2048
EP_EXPERTS = GLM5.n_routed_experts // 16     # the routed experts of one rank at EP = 16
PREFILL_TOKENS = 4096

_FP8_GEMM_FP32 = Close(dtype=torch.float32, widen=8,
                       why="float32 sum of K products (128-block partial sums times their scales) in "
                           "any order: rounding error grows ~sqrt(K)")


def _gemm_rule(out_dtype: torch.dtype, k: int, *, integer: bool) -> Close:
    if out_dtype == torch.float32 and not integer and k > GEMM_BLOCK:
        return _FP8_GEMM_FP32
    return Close(dtype=out_dtype)


def _log_uniform(g, shape, low: float, high: float) -> torch.Tensor:
    """2^u with u uniform in [low, high]."""
    return torch.exp2(uniform(g, shape, torch.float32, low, high))


def fp8_activations(g, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a float8_e4m3fn [m, k], a_scale float32 [m, k/128]) as `fp8_block_quant(x, 128)` makes
    them, from normal activations whose magnitude differs per block by up to 2^2 either way
    (outputs stay O(1)), so that a scale applied to the wrong row or block shows."""
    blocks = k // GEMM_BLOCK
    x = randn(g, (m, blocks, GEMM_BLOCK), torch.float32) * _log_uniform(g, (m, blocks, 1), -2, 2)
    return ref.fp8_block_quant(x.reshape(m, k), GEMM_BLOCK)


def fp8_weights(g, experts: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w float8_e4m3fn [experts, n, k], w_scale float32 [experts, ceil(n/128), k/128]): codes
    of normal values spread over the e4m3 range; block scales within a factor 2^2 of
    K^-0.5 / 112, so that outputs are O(1) and a misapplied block scale shows. Built one
    expert at a time in bfloat16 (the 16 experts' w13 alone are 403 MB of codes)."""
    w = torch.empty((experts, n, k), dtype=FP8)
    for e in range(experts):
        w[e] = torch.randn((n, k), generator=g, dtype=torch.bfloat16).mul_(112).clamp_(-448, 448).to(FP8)
    base = max(k, 1) ** -0.5 / 112
    return w, _log_uniform(g, (experts, -(-n // GEMM_BLOCK), k // GEMM_BLOCK), -2, 2) * base


def int8_activations(g, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x int8 [m, k], x_scale float32 [m]): int8_quant of normal rows whose magnitudes differ
    by up to 2^6 either way."""
    if k == 0:
        return torch.zeros((m, 0), dtype=I8), _log_uniform(g, (m,), -6, 6)
    return ref.int8_quant(randn(g, (m, k), torch.float32) * _log_uniform(g, (m, 1), -6, 6))


def int8_weights(g, experts: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w int8 [experts, n, k], w_scale float32 [experts, n]): codes of normal values (sigma 40,
    clamped to +-127, as per-channel symmetric quantization of normal weights makes them) and
    per-channel scales within 2^2 of K^-0.5 / 40, so that outputs are O(1). Built one expert at
    a time in bfloat16 (the 16 experts' w13 alone are 403 MB of codes)."""
    w = torch.empty((experts, n, k), dtype=I8)
    for e in range(experts):
        w[e] = torch.randn((n, k), generator=g, dtype=torch.bfloat16).mul_(40).round_().clamp_(-127, 127).to(I8)
    return w, _log_uniform(g, (experts, n), -2, 2) * (max(k, 1) ** -0.5 / 40)


def full_range_int8(g, shape) -> torch.Tensor:
    """Uniform over every int8 value, -128 included (int8_quant never makes it; the GEMMs take it)."""
    return torch.randint(-128, 128, shape, generator=g, dtype=I8)


def _strided(t: torch.Tensor) -> View:
    """`t` as a view into a wider tensor: the first columns of rows twice as long."""
    return View(torch.cat((t, t), dim=-1), lambda b, n=t.shape[-1]: b[..., :n])


def _transposed(t: torch.Tensor) -> View:
    """`t` [..., R, C] stored as [..., C, R] and viewed back."""
    return View(t.transpose(-1, -2).contiguous(), lambda b: b.transpose(-1, -2))


# -- fp8_block_gemm ------------------------------------------------------------------------------
def _fp8_gemm_inputs(g, m, n, k, out_dtype, fill=None, view=None):
    """fill: "nan" (a nan code in a row of a and in a row of w: that output row and column
    are nan, nothing else), "zero_scales" (some block scales 0: those blocks contribute 0).
    view: "a_slice" | "w_transposed" | "scales_transposed"."""
    a, a_scale = fp8_activations(g, m, k)
    w, w_scale = (t[0] for t in fp8_weights(g, 1, n, k))
    if fill == "nan":
        a.view(torch.uint8)[m // 2, k - 1] = 0x7F
        w.view(torch.uint8)[n - 1, 0] = 0xFF
    elif fill == "zero_scales":
        a_scale[::2, 0] = 0
        w_scale[0, -1] = 0
    if view == "a_slice":
        a = _strided(a)
    elif view == "w_transposed":
        w = _transposed(w)
    elif view == "scales_transposed":
        a_scale, w_scale = _transposed(a_scale), _transposed(w_scale)
    return a, a_scale, w, w_scale, out_dtype


def _fp8_gemm_case(preset, name, m, n, k, out_dtype, *, fill=None, view=None, note=""):
    return Case("fp8_block_gemm", preset, f"{name}_{_OUT_NAMES[out_dtype]}", FP8,
                lambda g: _fp8_gemm_inputs(g, m, n, k, out_dtype, fill, view),
                {"out": _gemm_rule(out_dtype, k, integer=False)},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


def _fp8_gemm_error(name: str, change, note: str) -> Case:
    """Valid inputs a [3, 256], w [129, 256] with one argument replaced: change(args) -> args."""
    return Case("fp8_block_gemm", "tiny", name, FP8,
                lambda g: change(list(_fp8_gemm_inputs(g, 3, 129, 256, torch.bfloat16))), outcome=ERROR,
                note=note)


def _replace(args: list, index: int, value) -> tuple:
    args[index] = value(args[index]) if callable(value) else value
    return tuple(args)


def _fp8_gemm_errors():
    def k_258(args):
        a, a_scale, w, w_scale, out = args
        return torch.cat((a, a[:, :2]), 1), a_scale, torch.cat((w, w[:, :2]), 1), w_scale, out

    yield _fp8_gemm_error("k_not_multiple_of_128", k_258, "K = 258 is not a whole number of 128-blocks")
    yield _fp8_gemm_error("a_scale_extra_block", lambda a: _replace(a, 1, lambda s: torch.cat((s, s[:, :1]), 1)),
                          "a_scale [M, K/128 + 1]")
    yield _fp8_gemm_error("w_scale_rows_floor", lambda a: _replace(a, 3, lambda s: s[:1]),
                          "N = 129 has ceil(129/128) = 2 rows of weight blocks, w_scale has 1")
    yield _fp8_gemm_error("w_scale_k_blocks", lambda a: _replace(a, 3, lambda s: s[:, :1]),
                          "w_scale with 1 of the 2 K blocks")
    yield _fp8_gemm_error("a_scale_bfloat16", lambda a: _replace(a, 1, lambda s: s.bfloat16()),
                          "scales are float32")
    yield _fp8_gemm_error("w_bfloat16", lambda a: _replace(a, 2, lambda w: w.bfloat16()),
                          "a bfloat16 weight with FP8 activations")
    yield _fp8_gemm_error("out_dtype_int32", lambda a: _replace(a, 4, torch.int32),
                          "out_dtype is bfloat16, float16 or float32")


@generator("fp8_block_gemm")
def fp8_block_gemm_cases(preset: str):
    if preset == "tiny":
        for out in OUT_DTYPES:
            def case(name, m, n, k, **kw):
                return _fp8_gemm_case(preset, name, m, n, k, out, **kw)
            yield case("m1_n1_k128", 1, 1, 128)
            yield case("m3_n17_k128", 3, 17, 128)
            yield case("m17_n129_k256", 17, 129, 256, note="a partial last weight block (N = 129)")
            yield case("m33_n200_k384", 33, 200, 384)
            yield case("m64_n256_k256", 64, 256, 256, note="whole tiles")
            yield case("m129_n33_k512", 129, 33, 512)
            yield case("m300_n130_k640", 300, 130, 640, note="several row tiles, 5 K blocks")
            yield case("nan_codes", 5, 40, 256, fill="nan", note="a nan code poisons its row or column only")
            yield case("zero_scales", 6, 130, 384, fill="zero_scales", note="zero block scales")
            yield case("empty_m", 0, 17, 128)
            yield case("empty_n", 3, 0, 128)
            yield case("k0", 3, 5, 0, note="K = 0: every output is 0")
            yield case("noncontig_a", 5, 40, 256, view="a_slice")
            yield case("noncontig_w", 5, 40, 256, view="w_transposed", note="w stored [K, N]")
            yield case("noncontig_scales", 5, 140, 256, view="scales_transposed")
        yield from _fp8_gemm_errors()
    elif preset == "glm5":
        def case(name, m, shape, out=torch.bfloat16, note=""):
            return _fp8_gemm_case(preset, name, m, *shape, out, note=note)
        yield case("q_a_proj_m1", 1, Q_A, note="q_a_proj, decode of one token")
        for out in OUT_DTYPES:
            yield case("q_a_proj_m64", 64, Q_A, out, note="q_a_proj, decode of 64 tokens")
        yield case("kv_a_proj_m16", 16, KV_A, note="kv_a_proj_with_mqa: N = 576, a partial last weight block")
        yield case(f"kv_a_proj_m{PREFILL_TOKENS}", PREFILL_TOKENS, KV_A,
                   note="prefill; the projection whose float64 reference stays affordable at M = 4096")
        yield case("q_b_proj_m5", 5, Q_B, note="q_b_proj: 64 heads x 256")
        yield case("kv_b_proj_m5", 5, KV_B, note="kv_b_proj: K = 512")
        for out in (torch.bfloat16, torch.float32):
            yield case("o_proj_m5", 5, O_PROJ, out, note="o_proj: K = 16384, the longest sum")


# -- int8_quant ----------------------------------------------------------------------------------
class Int8Codes:
    """The int8 codes of `int8_quant` as RNE rounding of `source / scale` makes them (judged
    with `Exact` next to a check of the scales), like `Fp8Codes`: where `source / scale`
    lies within `INT8_TIE_WINDOW` (relative) of a midpoint n + 1/2, either neighbour is
    accepted (on both sides mapped to the even one): the quotient is a float32 division,
    and an evaluation through a reciprocal or a scale an ulp off may land on either side.
    With a power-of-two scale every evaluation of the quotient is exact, so there a midpoint
    must round to even. Rows with scale 0 must have codes 0. Each side is judged with its own
    scales."""
    tolerance_dtype = torch.float32
    INT8_TIE_WINDOW = 2.0 ** -20   # 8 float32 ulps, far below the code spacing of 1

    def __init__(self, scale: str, source: str):
        self.scale, self.source = scale, source

    def __call__(self, q: torch.Tensor, resolve) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype != I8:
            raise ValueError(f"int8 codes must be int8, got {str(q.dtype).removeprefix('torch.')}")
        s = resolve(self.scale).to(torch.float64).unsqueeze(-1)
        x = resolve(self.source).to(torch.float64)
        if x.shape != q.shape or s.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"source {list(x.shape)} and scales {list(s.shape[:-1])} do not match "
                             f"int8 codes {list(q.shape)}")
        r = torch.where(s == 0, 0.0, x / s).clamp(-127, 127)
        lo = r.floor()
        mid = lo + 0.5
        exact_quotient = torch.frexp(s).mantissa.abs() == 0.5      # a power-of-two scale
        near = ((r - mid).abs() <= self.INT8_TIE_WINDOW * mid.abs()) & ~((r == mid) & exact_quotient)
        codes = q.to(torch.float64)
        either = near & ((codes == lo) | (codes == lo + 1))
        even = torch.where(lo.remainder(2) == 0, lo, lo + 1)
        return torch.where(either, even, codes), s.expand(q.shape)

    def __str__(self) -> str:
        return f"int8 codes of '{self.source}' / '{self.scale}' (round half to even)"


_INT8_CODES = Exact(dtype=I8, transform=Int8Codes("out[1]", source="x"))
_INT8_SCALES = Close(dtype=torch.float32)
# Rows whose amax is 127 (scale exactly 1, times 2^k when scaled by 2^k): each value is an exact
# half and must go to the even integer, some away from zero, some toward it.
INT8_TIES = (127.0, 0.5, 1.5, 2.5, -2.5, 3.5, -3.5, 126.5, -126.5, 64.5, -0.5, 0.0, 1.0, -127.0, 100.5, 7.5)


def _int8_quant_inputs(g, shape, dtype, fill=None, view=None, scale=1.0):
    """fill: "ties" (rows of INT8_TIES times 1, 2^-4, 2^5 and -1), "zero_rows" (every other
    row 0: scale 0, codes 0), "underflow" (rows of ~1e-41: their scale amax / 127 is a
    float32 subnormal or 0), "negative_amax" (each row's largest magnitude negative: -127).
    view: "transposed" | "strided" (every other element)."""
    if fill == "ties":
        base = torch.tensor(INT8_TIES)
        return torch.stack([base, base * 2 ** -4, base * 32, -base]).to(dtype)
    x = randn(g, shape, torch.float32, scale)
    if fill == "zero_rows":
        x.view(-1, shape[-1])[::2] = 0
    elif fill == "underflow":
        x = x * 1e-41
    elif fill == "negative_amax":
        x[..., 0] = -x.abs().amax(-1) * 1.5
    x = x.to(dtype)
    if view == "transposed":
        return _transposed(x)
    if view == "strided":
        return View(torch.stack((x, -x), dim=-1).flatten(-2), lambda b: b[..., ::2])
    return x


def _int8_quant_case(preset, name, dtype, shape, *, fill=None, view=None, scale=1.0, note=""):
    return Case("int8_quant", preset, name, dtype, lambda g: (_int8_quant_inputs(g, shape, dtype, fill, view, scale),),
                {"out[0]": _INT8_CODES, "out[1]": _INT8_SCALES},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


@generator("int8_quant")
def int8_quant_cases(preset: str):
    for dtype in FLOATS:
        def case(name, shape, **kw):
            return _int8_quant_case(preset, name, dtype, shape, **kw)
        if preset == "tiny":
            yield case("rows1_k1", (1, 1), note="a row of one: its code is +-127")
            yield case("rows3_k17", (3, 17))
            yield case("rows17_k387", (17, 387))
            yield case("rows129_k64", (129, 64))
            yield case("vector_k100", (100,), note="a 1-d input: one row, a 0-d scale")
            yield case("batch2x3_k48", (2, 3, 48), note="3-d input")
            yield case("rounding_ties", (4, 16), fill="ties", note="exact halves of x / s go to the even integer")
            yield case("zero_rows", (4, 64), fill="zero_rows", note="all-zero rows: scale 0, codes 0")
            if dtype != torch.float16:   # float16 cannot hold 1e-41
                yield case("underflow", (3, 64), fill="underflow",
                           note="amax / 127 a float32 subnormal (or 0): no flush to zero")
            yield case("negative_amax", (5, 32), fill="negative_amax", note="q = -127, never -128")
            yield case("large_magnitude", (3, 64), scale=8000.0, note="amax near the float16 limit")
            yield case("empty_batch", (0, 64))
            yield case("noncontig_transposed", (5, 32), view="transposed")
            yield case("noncontig_strided", (3, 64), view="strided")
            yield Case("int8_quant", preset, "k0", dtype, lambda g, d=dtype: (torch.zeros(3, 0, dtype=d),),
                       outcome=ERROR, note="rows of no elements have no maximum")
        elif preset == "glm5":
            yield case("hidden6144_t5", (GLM5_TOKENS, GLM5.hidden_size), note="before q_a / kv_a, decode")
            yield case("hidden6144_t1024", (1024, GLM5.hidden_size), note="before q_a / kv_a, a prefill chunk")
            yield case("heads_v_t5", (GLM5_TOKENS, O_PROJ[1]), note="o_proj's input: 64 heads x 256")
            yield case("expert_rows_t40", (40, GLM5.moe_intermediate_size),
                       note="w2's input: 5 tokens x top-8 permuted rows")


# -- int8_gemm -----------------------------------------------------------------------------------
def _int8_gemm_inputs(g, m, n, k, out_dtype, bias=False, fill=None, view=None):
    """fill: "full_range" (codes over all of int8, -128 included, scales 2^-u),
    "zero_scales" (some row and channel scales 0).
    view: "x_slice" | "w_transposed" | "scales_strided"."""
    if fill == "full_range":
        x, w = full_range_int8(g, (m, k)), full_range_int8(g, (n, k))
        x_scale, w_scale = _log_uniform(g, (m,), -12, -4), _log_uniform(g, (n,), -12, -4)
    else:
        x, x_scale = int8_activations(g, m, k)
        w, w_scale = (t[0] for t in int8_weights(g, 1, n, k))
    if fill == "zero_scales":
        x_scale[::2] = 0
        w_scale[1::3] = 0
    b = randn(g, (n,), torch.float32) if bias else None
    if view == "x_slice":
        x = _strided(x)
    elif view == "w_transposed":
        w = _transposed(w)
    elif view == "scales_strided":
        x_scale, w_scale = _strided(x_scale), _strided(w_scale)
        b = _strided(b) if b is not None else None
    return x, x_scale, w, w_scale, out_dtype, b


def _int8_gemm_case(preset, name, m, n, k, out_dtype, *, bias=False, fill=None, view=None, note=""):
    return Case("int8_gemm", preset, f"{name}_{_OUT_NAMES[out_dtype]}", I8,
                lambda g: _int8_gemm_inputs(g, m, n, k, out_dtype, bias, fill, view),
                {"out": _gemm_rule(out_dtype, k, integer=True)},
                outcome=RESULT_OR_ERROR if view else RESULT, note=note)


def _cancelling_sum(g, out_dtype):
    """x = 127, w = +127 for the first half of K = 65536 and -127 for the second, plus a last
    product of 1: every partial sum up to 2^29 is exact in int32 and the result is exactly 1
    (times scales 1); a float32 accumulator loses it (its spacing there is 32-64)."""
    k = 65536
    x = torch.full((2, k + 1), 127, dtype=I8)
    x[:, -1] = 1
    w = torch.full((3, k + 1), 127, dtype=I8)
    w[:, k // 2:] = -127
    w[:, -1] = torch.tensor([1, 2, -3], dtype=I8)
    return x, torch.ones(2), w, torch.ones(3), out_dtype, None


def _largest_sum(g, out_dtype):
    """K = 131071 (the contract's largest) products of -128 * -128: 2147467264, an int32 that
    a biased-unsigned (VNNI u8 x s8) formulation reaches only through wrap-around."""
    k = 131071
    x = torch.full((1, k), -128, dtype=I8)
    w = torch.full((2, k), -128, dtype=I8)
    w[1, ::2] = 127
    return x, torch.ones(1), w, torch.full((2,), 2.0 ** -31), out_dtype, None


def _int8_gemm_error(name: str, change, note: str) -> Case:
    """Valid inputs x [3, 67], w [17, 67], bias [17] with one argument replaced."""
    return Case("int8_gemm", "tiny", name, I8,
                lambda g: change(list(_int8_gemm_inputs(g, 3, 17, 67, torch.bfloat16, bias=True))),
                outcome=ERROR, note=note)


def _int8_gemm_errors():
    yield Case("int8_gemm", "tiny", "k_beyond_int32", I8,
               lambda g: (torch.zeros(1, 131072, dtype=I8), torch.ones(1), torch.zeros(2, 131072, dtype=I8),
                          torch.ones(2), torch.bfloat16, None),
               outcome=ERROR, note="K = 131072: 128^2 * K no longer fits the int32 accumulator")
    yield _int8_gemm_error("x_scale_per_block", lambda a: _replace(a, 1, lambda s: s[:, None]),
                           "x_scale is one scale per row [M]")
    yield _int8_gemm_error("w_scale_short", lambda a: _replace(a, 3, lambda s: s[:-1]), "w_scale [N - 1]")
    yield _int8_gemm_error("bias_short", lambda a: _replace(a, 5, lambda b: b[:-1]), "bias [N - 1]")
    yield _int8_gemm_error("bias_bfloat16", lambda a: _replace(a, 5, lambda b: b.bfloat16()), "bias is float32")
    yield _int8_gemm_error("w_scale_float16", lambda a: _replace(a, 3, lambda s: s.half()), "scales are float32")
    yield _int8_gemm_error("w_int32", lambda a: _replace(a, 2, lambda w: w.int()), "int8 weights")
    yield _int8_gemm_error("out_dtype_int32", lambda a: _replace(a, 4, torch.int32),
                           "out_dtype is bfloat16, float16 or float32")


@generator("int8_gemm")
def int8_gemm_cases(preset: str):
    if preset == "tiny":
        for out in OUT_DTYPES:
            def case(name, m, n, k, **kw):
                return _int8_gemm_case(preset, name, m, n, k, out, **kw)
            yield case("m1_n1_k1", 1, 1, 1)
            yield case("m3_n17_k5", 3, 17, 5, note="K shorter than one 4-byte VNNI step")
            yield case("m17_n129_k67", 17, 129, 67, note="K past one 64-byte vector, not a multiple of 4")
            yield case("m33_n64_k256", 33, 64, 256, bias=True)
            yield case("m64_n48_k128", 64, 48, 128, note="whole tiles")
            yield case("m129_n33_k100", 129, 33, 100, bias=True)
            yield case("m300_n70_k300", 300, 70, 300, note="several row tiles")
            yield case("full_range", 19, 37, 200, fill="full_range", note="every int8 value, -128 included")
            yield case("zero_scales", 6, 20, 64, fill="zero_scales", bias=True)
            yield case("empty_m", 0, 17, 64, bias=True)
            yield case("empty_n", 3, 0, 64)
            yield case("k0", 3, 5, 0, bias=True, note="K = 0: the bias alone")
            yield case("noncontig_x", 5, 40, 96, view="x_slice")
            yield case("noncontig_w", 5, 40, 96, view="w_transposed", note="w stored [K, N]")
            yield case("noncontig_scales", 5, 40, 96, view="scales_strided", bias=True)
            yield Case("int8_gemm", preset, f"exact_cancelling_sum_{_OUT_NAMES[out]}", I8,
                       lambda g, out=out: _cancelling_sum(g, out), {"out": Close(dtype=out)},
                       note="partial sums up to 2^29 cancel to exactly 1: only an exact integer sum passes")
            yield Case("int8_gemm", preset, f"largest_sum_{_OUT_NAMES[out]}", I8,
                       lambda g, out=out: _largest_sum(g, out), {"out": Close(dtype=out)},
                       note="K = 131071 products of -128 * -128")
        yield from _int8_gemm_errors()
    elif preset == "glm5":
        def case(name, m, shape, out=torch.bfloat16, bias=False, note=""):
            return _int8_gemm_case(preset, name, m, *shape, out, bias=bias, note=note)
        yield case("q_a_proj_m1", 1, Q_A, note="decode of one token")
        for out in OUT_DTYPES:
            yield case("q_a_proj_m64", 64, Q_A, out, note="decode of 64 tokens")
        yield case("kv_a_proj_m16_bias", 16, KV_A, bias=True)
        yield case(f"kv_a_proj_m{PREFILL_TOKENS}", PREFILL_TOKENS, KV_A,
                   note="prefill; the projection whose float64 reference stays affordable at M = 4096")
        yield case("o_proj_m5", 5, O_PROJ, torch.float32, note="K = 16384")


# -- fp8_grouped_gemm / int8_grouped_gemm --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GroupedSpec:
    """counts: rows per expert, or ("routed", tokens, top_k, experts): moe_permute's counts of
    a random top-k routing."""
    name: str
    counts: tuple
    n: int
    k: int
    outs: tuple = OUT_DTYPES
    view: str = ""             # "" | "x_slice" | "w_transposed"
    note: str = ""


def _counts(g, counts: tuple) -> torch.Tensor:
    if counts and counts[0] == "routed":
        from .moe import routed_ids
        _, tokens, top_k, experts = counts
        return ref.moe_permute(torch.zeros(tokens, 1), routed_ids(g, tokens, top_k, experts), experts)[1]
    return torch.tensor(counts, dtype=I32)


# 64 decode rows over the 16 experts of a rank, 6 of them idle; 512 prefill rows with whole row
# tiles and remainders per expert, 2 idle
_DECODE_COUNTS = (9, 0, 4, 1, 0, 0, 12, 3, 0, 7, 2, 0, 15, 0, 6, 5)
_PREFILL_COUNTS = (64, 0, 48, 31, 1, 33, 64, 16, 40, 39, 25, 0, 63, 32, 24, 32)


def _grouped_specs(preset: str, k: int) -> list[GroupedSpec]:
    S = GroupedSpec
    if preset == "tiny":
        return [
            S("e1_m1", (1,), 1, k),
            S("e3_m17", (5, 0, 12), 17, k),
            S("e17_m129", (0, 9, 0, 0, 30, 1, 0, 17, 0, 0, 40, 0, 2, 0, 0, 30, 0), 129, k,
              note="zero-row experts between and around busy ones"),
            S("zero_row_ends", (0, 3, 0, 0, 4, 0), 40, k, note="the first and last experts have no rows"),
            S("one_busy_expert", (0, 0, 130, 0), 33, k, note="130 rows: several row tiles of one expert"),
            S("routed_e33_t17_top3", ("routed", 17, 3, 33), 17, k),
            S("empty_batch", (0, 0, 0), 17, k, note="M = 0"),
            S("no_experts", (), 17, k, note="E = 0, M = 0"),
            S("noncontig_x", (5, 0, 12), 17, k, view="x_slice"),
            S("noncontig_w", (5, 0, 12), 17, k, view="w_transposed", note="w stored [E, K, N]"),
        ]
    bf16 = (torch.bfloat16,)
    return [
        S("w13_e16_decode_m64", _DECODE_COUNTS, *W13, outs=bf16,
          note=f"gate/up projections of the {EP_EXPERTS} experts of an EP rank, 64 decode rows"),
        S("w2_e16_decode_m64", _DECODE_COUNTS, *W2, outs=bf16, note="down projections, the same rows"),
        S("w2_e16_prefill_m512", _PREFILL_COUNTS, *W2, outs=bf16,
          note="512 prefill rows: whole row tiles and remainders per expert at the real width"),
    ]


def _grouped_inputs(g, op, counts, n, k, out_dtype, view=""):
    counts = _counts(g, counts)
    experts, rows = counts.shape[0], int(counts.clamp(min=0).sum())
    if op == "fp8_grouped_gemm":
        (x, x_scale), (w, w_scale) = fp8_activations(g, rows, k), fp8_weights(g, experts, n, k)
    else:
        (x, x_scale), (w, w_scale) = int8_activations(g, rows, k), int8_weights(g, experts, n, k)
    if view == "x_slice":
        x = _strided(x)
    elif view == "w_transposed":
        w = _transposed(w)
    return x, x_scale, w, w_scale, counts, out_dtype


def _grouped_error(op: str, name: str, counts: tuple, rows: int, note: str, change=lambda a: tuple(a)) -> Case:
    k = 256 if op == "fp8_grouped_gemm" else 67
    experts = max(len(counts), 1)

    def inputs(g):
        args = list(_grouped_inputs(g, op, (0,) * experts, 17, k, torch.bfloat16))
        x, x_scale = (fp8_activations if op == "fp8_grouped_gemm" else int8_activations)(g, rows, k)
        args[0], args[1], args[4] = x, x_scale, torch.tensor(counts, dtype=I32)
        if not counts:
            args[2], args[3] = args[2][:0], args[3][:0]
        return change(args)

    return Case(op, "tiny", name, FP8 if op == "fp8_grouped_gemm" else I8, inputs, outcome=ERROR, note=note)


def _grouped_cases(op: str, preset: str):
    k = 256 if op == "fp8_grouped_gemm" else 67   # INT8: no multiple of the 4- or 64-byte steps
    for spec in _grouped_specs(preset, k):
        name = f"{spec.name}_n{spec.n}_k{spec.k}" if preset == "tiny" else spec.name
        for out in spec.outs:
            yield Case(op, preset, f"{name}_{_OUT_NAMES[out]}", FP8 if op == "fp8_grouped_gemm" else I8,
                       lambda g, spec=spec, out=out: _grouped_inputs(g, op, spec.counts, spec.n, spec.k, out,
                                                                     spec.view),
                       {"out": _gemm_rule(out, spec.k, integer=op != "fp8_grouped_gemm")},
                       outcome=RESULT_OR_ERROR if spec.view else RESULT, note=spec.note)
    if preset != "tiny":
        return
    yield _grouped_error(op, "counts_sum_below_rows", (5, 0, 11), 17, "sum 16 < M = 17")
    yield _grouped_error(op, "counts_sum_above_rows", (5, 1, 12), 17, "sum 18 > M = 17")
    yield _grouped_error(op, "negative_count", (6, -1, 12), 17, "a count < 0")
    yield _grouped_error(op, "rows_without_experts", (), 4, "E = 0 but M = 4")
    yield _grouped_error(op, "w_scale_experts", (5, 0, 12), 17, "w_scale of 2 of the 3 experts",
                         lambda a: _replace(a, 3, lambda s: s[:2]))
    if op == "fp8_grouped_gemm":
        def k_320(args):
            args[0] = torch.cat((args[0], args[0][:, :64]), 1)
            args[2] = torch.cat((args[2], args[2][:, :, :64]), 2)
            return tuple(args)
        yield _grouped_error(op, "k_not_multiple_of_128", (5, 0, 12), 17, "K = 320", k_320)
    else:
        yield _grouped_error(op, "w_scale_per_block", (5, 0, 12), 17, "INT8 weight scales are per channel [E, N]",
                             lambda a: _replace(a, 3, lambda s: s[:, :, None]))


@generator("fp8_grouped_gemm")
def fp8_grouped_gemm_cases(preset: str):
    yield from _grouped_cases("fp8_grouped_gemm", preset)


@generator("int8_grouped_gemm")
def int8_grouped_gemm_cases(preset: str):
    yield from _grouped_cases("int8_grouped_gemm", preset)
