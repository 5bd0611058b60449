"""The tolerance model: a base (rtol, atol) per output dtype, widened only by a declared,
justified factor.

A floating element passes iff `|out - ref| <= atol + rtol * |ref|`. The base table is the
one in CONFORMANCE.md: roughly a couple of ulps of the output dtype (one rounding of the
result plus float32 accumulation) and an absolute floor for values near zero. FP8 outputs
are compared after dequantization; their atol is *scale-relative*: it is multiplied by the
quantization scale of the element's block, because that scale sets the grid spacing.
"""
from __future__ import annotations

import dataclasses

import torch

#: dtype -> (rtol, atol). float8_e4m3fn: 1.25e-1 = one ulp of its 3-bit mantissa; atol 2^-9
#: = the spacing of its subnormals, in units of the block scale.
BASE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float8_e4m3fn: (1.25e-1, 2.0 ** -9),
}
SCALE_RELATIVE = frozenset({torch.float8_e4m3fn})


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Effective bounds for one output: `atol (* scale) + rtol * |ref|`."""
    dtype: torch.dtype
    rtol: float
    atol: float
    scale_relative: bool = False
    widen: float = 1.0
    why: str = ""

    def bound(self, ref_abs: torch.Tensor, unit: torch.Tensor | None = None) -> torch.Tensor:
        """Per-element bound; `unit` is the dequantization scale (scale-relative atol)."""
        if self.scale_relative:
            if unit is None:
                raise ValueError(f"the {_name(self.dtype)} tolerance is scale-relative: compare "
                                 "these outputs through a dequantizing transform")
            return self.atol * unit + self.rtol * ref_abs
        return self.atol + self.rtol * ref_abs

    def describe(self) -> str:
        atol = f"{self.atol:.3g}" + (" x scale" if self.scale_relative else "")
        text = f"{_name(self.dtype)}: rtol {self.rtol:.3g}, atol {atol}"
        if self.widen != 1.0:
            text += f" (base x{self.widen:g}: {self.why})"
        return text


def check_widening(widen: float, why: str) -> None:
    """A widening factor is >= 1 and comes with a one-line justification."""
    if not isinstance(widen, (int, float)) or isinstance(widen, bool) or not widen >= 1.0:
        raise ValueError(f"tolerance widening must be a number >= 1, got {widen!r}")
    if widen != 1.0 and (not why.strip() or "\n" in why.strip()):
        raise ValueError(f"widening the tolerance x{widen:g} needs a one-line justification "
                         f"(why=...), got {why!r}")


def tolerance(dtype: torch.dtype, widen: float = 1.0, why: str = "") -> Tolerance:
    """The base tolerance of `dtype`, times `widen` (which needs a justification)."""
    check_widening(widen, why)
    if dtype not in BASE:
        raise ValueError(f"no base tolerance for {_name(dtype)}; known: "
                         f"{', '.join(_name(d) for d in BASE)} (compare integers with Exact)")
    rtol, atol = BASE[dtype]
    return Tolerance(dtype, rtol * widen, atol * widen, dtype in SCALE_RELATIVE, float(widen), why.strip())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
