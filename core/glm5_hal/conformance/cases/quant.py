"""Cases for the quantization ops (OPS.md section 3).

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

import torch

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
