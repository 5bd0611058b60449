"""Benchmark cases of the elementwise ops: a prefill chunk of tokens."""
from __future__ import annotations

import torch

from ...presets import GLM5
from ..runner import BenchCase
from . import Shapes, bench_case, randn, seeded


@bench_case("rms_norm")
def rms_norm(s: Shapes) -> BenchCase:
    T, H = s.tokens, s.hidden
    return BenchCase(f"[{T}, {H}] bf16",
                     lambda: (randn(seeded("rms"), (T, H)), randn(seeded("rms-w"), (H,)), GLM5.rms_norm_eps),
                     nbytes=4 * T * H)


@bench_case("silu_and_mul")
def silu_and_mul(s: Shapes) -> BenchCase:
    M, I = s.tokens * s.top_k, s.moe_intermediate
    return BenchCase(f"[{M}, {2 * I}] bf16", lambda: (randn(seeded("silu"), (M, 2 * I)),), nbytes=6 * M * I)


@bench_case("apply_rope")
def apply_rope(s: Shapes) -> BenchCase:
    T, ctx = s.tokens, s.context
    return BenchCase(f"[{T}, {s.heads}, {s.rope_dim}] bf16",
                     lambda: (randn(seeded("rope"), (T, s.heads, s.rope_dim)), torch.arange(ctx, ctx + T),
                              GLM5.rope_theta, True),
                     nbytes=4 * T * s.heads * s.rope_dim)


@bench_case("hadamard_transform")
def hadamard_transform(s: Shapes) -> BenchCase:
    T, Hi, Di = s.tokens, s.index_heads, s.index_dim
    return BenchCase(f"[{T}, {Hi}, {Di}] bf16", lambda: (randn(seeded("had"), (T, Hi, Di)), Di ** -0.5),
                     nbytes=4 * T * Hi * Di)
