"""Benchmark cases of the MoE ops: routing and permutation of a prefill chunk, and the
grouped GEMM of one expert-parallel rank's experts."""
from __future__ import annotations

import torch

from ...presets import GLM5
from ..runner import BenchCase
from . import BF16, F32, I32, Shapes, bench_case, randn, routing, seeded


@bench_case("moe_route")
def moe_route(s: Shapes) -> BenchCase:
    T, E, k = s.tokens, s.experts, s.top_k
    return BenchCase(f"[{T}, {E}] fp32 top-{k}",
                     lambda: (randn(seeded("route"), (T, E), F32), randn(seeded("bias"), (E,), F32, 0.01), k,
                              GLM5.n_group, GLM5.topk_group, GLM5.routed_scaling_factor, True, "sigmoid"),
                     nbytes=4 * T * E)


@bench_case("moe_permute")
def moe_permute(s: Shapes) -> BenchCase:
    T, H, E, k = s.tokens, s.hidden, s.experts, s.top_k
    return BenchCase(f"[{T}, {H}] bf16 top-{k} of {E}",
                     lambda: (randn(seeded("perm"), (T, H)), routing(seeded("ids"), T, E, k), E),
                     nbytes=4 * T * k * H)


@bench_case("moe_unpermute")
def moe_unpermute(s: Shapes) -> BenchCase:
    T, H, E, k = s.tokens, s.hidden, s.experts, s.top_k
    M = T * k

    def make():
        from ... import reference
        _, _, src = reference.moe_permute(torch.empty(T, 0, dtype=BF16), routing(seeded("ids"), T, E, k), E)
        return randn(seeded("unperm"), (M, H)), src, torch.rand(T, k, generator=seeded("w"))

    return BenchCase(f"[{M}, {H}] bf16 -> [{T}, {H}]", make, nbytes=2 * M * H + 2 * T * H)


@bench_case("grouped_gemm")
def grouped_gemm(s: Shapes) -> BenchCase:
    H, I = s.hidden, s.moe_intermediate
    experts, rows = s.local_experts, max(1, s.tokens * s.top_k * s.local_experts // s.experts)

    def make():
        g = seeded("gg")
        counts = torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts).to(I32)
        return randn(g, (rows, H)), randn(g, (experts, 2 * I, H), BF16, H ** -0.5), counts

    return BenchCase(f"{experts} experts, [{rows}, {H}] x [{2 * I}, {H}] bf16", make,
                     flops=2 * rows * 2 * I * H, nbytes=2 * experts * 2 * I * H + 2 * rows * (H + 2 * I),
                     compute="bf16", baselines=(("torch: bf16 mm per expert", torch_per_expert),))


def torch_per_expert(x, w, tokens_per_expert):
    """torch's bf16 GEMM (oneDNN) once per expert into slices of one output: the cpu backend's
    grouped_gemm before it had native tiles."""
    from glm5_hal.backends.cpu.moe import per_expert_mm
    return per_expert_mm(x, w, tokens_per_expert)
