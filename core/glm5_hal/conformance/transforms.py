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
    """`q.float() * scale`, one scale per block of the last dim (OPS.md section 3).

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
    as `q + 8`; the value is `q * scale[:, k // group_size]` (OPS.md section 3)."""
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


Transform = Fp8Dequant | Int4Dequant
