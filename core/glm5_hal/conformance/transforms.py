"""Transforms applied to an output before it is compared (a parameter of a rule).

Low-precision outputs are judged by the values they stand for: an FP8 tensor together with
its scales, a packed INT4 tensor together with its group scales. A transform names the
target holding those scales ("out[1]", or an argument name for in-place ops) and is applied
to each side with that side's own scales. It returns float64 values and the per-element
quantization unit (what a scale-relative atol is measured in).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

#: resolves a target name ("out", "out[1]", "k_scale") to that side's CPU tensor
Resolve = Callable[[str], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Fp8Dequant:
    """`q.float() * scale`, one scale per block of the last dim (docs/ops/quant.md).

    The block size follows from the shapes: `scale` has q's leading dims and
    `q.shape[-1] / block` blocks (`fp8_block_quant`), or one dim less with one scale per
    row (`indexer_k_cache_write`: k_cache [nb, bs, D] with k_scale [nb, bs])."""
    scale: str
    tolerance_dtype = torch.float8_e4m3fn

    def __call__(self, q: torch.Tensor, resolve: Resolve) -> tuple[torch.Tensor, torch.Tensor]:
        s = resolve(self.scale).to(torch.float64)
        if s.dim() == q.dim() - 1:
            s = s.unsqueeze(-1)
        if s.dim() != q.dim() or s.shape[:-1] != q.shape[:-1] or s.shape[-1] == 0 \
                or q.shape[-1] % s.shape[-1]:
            raise ValueError(f"scales {list(s.shape)} do not block fp8 values {list(q.shape)}")
        block = q.shape[-1] // s.shape[-1]
        unit = s.repeat_interleave(block, dim=-1)
        return q.to(torch.float64) * unit, unit

    def __str__(self) -> str:
        return f"fp8 dequantization with scales '{self.scale}'"


@dataclasses.dataclass(frozen=True)
class Int4Dequant:
    """`int4_unpack`: element `8j + i` of a row is bits `4i..4i+3` of `packed[:, j]`, stored
    as `q + 8`; the value is `q * scale[:, k // group_size]` (docs/ops/quant.md)."""
    scale: str
    group_size: int
    tolerance_dtype = torch.float32

    def __call__(self, packed: torch.Tensor, resolve: Resolve) -> tuple[torch.Tensor, torch.Tensor]:
        s = resolve(self.scale).to(torch.float64)
        if packed.dtype != torch.int32 or packed.dim() != 2:
            raise ValueError(f"packed int4 must be a 2-d int32 tensor, got "
                             f"{str(packed.dtype).removeprefix('torch.')} {list(packed.shape)}")
        n, k = packed.shape[0], packed.shape[1] * 8
        if s.shape != (n, k // self.group_size) or k % self.group_size:
            raise ValueError(f"scales {list(s.shape)} do not match {k} int4 values per row "
                             f"in groups of {self.group_size}")
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
        q = (nibbles.reshape(n, k) - 8).to(torch.float64)
        unit = s.repeat_interleave(self.group_size, dim=-1)
        return q * unit, unit

    def __str__(self) -> str:
        return f"int4 dequantization with scales '{self.scale}' (group {self.group_size})"


FP8_MAX = 448.0
#: how close (relative) to a rounding midpoint x / scale may lie for either neighbour to be
#: accepted: 8 float32 ulps, room for a quotient evaluated as x * (448 / amax) or with a
#: scale an ulp or two off, far below the spacing of e4m3 values (2^-3 relative)
FP8_TIE_WINDOW = 2.0 ** -20


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, in float64 (NaN codes 0x7F/0xFF left out)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = codes.to(torch.float64)
    return values[torch.isfinite(values)].unique()


def _e4m3_even(v: torch.Tensor) -> torch.Tensor:
    """Whether each e4m3 value (float64, finite) has an even code (last mantissa bit 0)."""
    return (v.to(torch.float8_e4m3fn).view(torch.uint8) & 1) == 0


@dataclasses.dataclass(frozen=True)
class Fp8Codes:
    """The FP8 values themselves (not dequantized), as RNE rounding of `source / scale` must
    make them: judged with `Exact` next to a check of the scales.

    A dequantized comparison allows an e4m3 ulp (rtol 2^-3), which cannot tell round-to-
    nearest-even from truncation; the codes can. Only where `source / scale` lies within
    `FP8_TIE_WINDOW` of a midpoint between two e4m3 values is either neighbour accepted (on
    both sides, either is mapped to the even one): float32 evaluation of the quotient
    (`x * (448 / amax)`, a reciprocal, a scale an ulp off) may land on either side. With a
    power-of-two scale every evaluation of the quotient is exact, so there a midpoint must
    round to even.

    scale: the target holding the scales (blocks as in `Fp8Dequant`).
    source: the argument that was quantized, `[..., K]` like the values; or, with `slots`,
        the rows `[T, D]` written into the slots `slot_mapping[t]` of a cache `[nb, bs, D]`
        (`indexer_k_cache_write`), whose other rows are compared as they are.
    """
    scale: str
    source: str
    slots: str | None = None
    tolerance_dtype = torch.float8_e4m3fn

    def __call__(self, q: torch.Tensor, resolve: Resolve) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 codes must be float8_e4m3fn, got {str(q.dtype).removeprefix('torch.')}")
        _, unit = Fp8Dequant(self.scale)(q, resolve)
        codes = q.to(torch.float64)
        x = resolve(self.source).to(torch.float64)
        if self.slots is None:
            if x.shape != q.shape:
                raise ValueError(f"source {list(x.shape)} does not match fp8 values {list(q.shape)}")
        else:
            rows = q.reshape(-1, q.shape[-1]).shape
            slots = resolve(self.slots).to(torch.int64)
            if x.dim() != 2 or x.shape[1] != rows[1] or slots.shape != (x.shape[0],):
                raise ValueError(f"source rows {list(x.shape)} and slots {list(slots.shape)} do "
                                 f"not fit a cache of rows {list(rows)}")
            written = slots >= 0
            scattered = torch.full(rows, float("nan"), dtype=torch.float64)
            scattered[slots[written]] = x[written]
            x = scattered.reshape(q.shape)
        r = (x / unit).clamp(-FP8_MAX, FP8_MAX)
        grid = _e4m3_grid()
        hi_at = torch.searchsorted(grid, r.nan_to_num(0.0).contiguous()).clamp(1, grid.numel() - 1)
        lo, hi = grid[hi_at - 1], grid[hi_at]
        mid = (lo + hi) / 2
        exact_quotient = torch.frexp(unit).mantissa.abs() == 0.5    # a power-of-two scale
        near = ((r - mid).abs() <= FP8_TIE_WINDOW * mid.abs()) & (r > lo) & (r < hi) \
            & ~((r == mid) & exact_quotient)
        either = near & ((codes == lo) | (codes == hi))
        # the even neighbour stands for both: each side decides "near" with its own scale
        canonical = torch.where(either, torch.where(_e4m3_even(lo), lo, hi), codes)
        return canonical, unit

    def __str__(self) -> str:
        where = f" into slots '{self.slots}'" if self.slots else ""
        return f"fp8 codes of '{self.source}'{where} / '{self.scale}' (round to nearest even)"


Transform = Fp8Dequant | Int4Dequant | Fp8Codes
