"""Cases for the elementwise / small ops (OPS.md section 2)."""
from __future__ import annotations

import torch

from ..case import RESULT, RESULT_OR_ERROR, Case, View, dtype_name, randn, uniform
from ..compare import Close
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
        elif preset == "glm5":
            t = (GLM5_TOKENS,)
            yield _rms_norm_case(preset, "hidden6144", dtype, t, 6144,
                                 note="input/post-attention/final norms")
            yield _rms_norm_case(preset, "q_lora2048", dtype, t, 2048, note="q_a_layernorm")
            yield _rms_norm_case(preset, "kv_lora512", dtype, t, 512, note="kv_a_layernorm")
            yield _rms_norm_case(preset, "kv_lora512_of_576", dtype, t, 512, view="slice", pad=64,
                                 note="kv_a_layernorm on the c_kv slice of kv_a_proj_with_mqa's output")
