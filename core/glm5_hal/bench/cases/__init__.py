"""Benchmark cases: every op at GLM-5 shapes (GLM-5's configuration, docs/models.md), one
module per op family (common, quant, dsa, moe, kv), like the conformance cases. A family module registers the
cases of each op (one, or a list: e.g. a GEMM at prefill and at decode shapes):

    @bench_case("rms_norm")
    def rms_norm(s: Shapes) -> BenchCase:
        return BenchCase(label=..., make=lambda: (...), nbytes=...)

Presets:
- `glm5`: the real per-layer shapes; token-wise ops over a 1024-token chunk, decode ops for
  a batch of 4 sequences at 8K context (the issue's moe_permute/unpermute, dispatch and
  sparse_mla_decode_paged targets);
- `long`: the same with decode at 32K context (the issue's indexer_topk_paged target);
- `tiny`: the same code paths on small shapes, for smoke tests and the dispatch section.

Each case builds its inputs when asked (`BenchCase.make()`), deterministically, and states
the flops and bytes its roofline percentage is computed from (bytes: what must move at
least once -- read + written -- not what a particular implementation moves).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
from typing import Callable

import torch

from ...presets import GLM5
from ..runner import BenchCase

PRESETS = ("glm5", "long", "tiny")
BF16, F32, FP8, I32 = torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32


@dataclasses.dataclass(frozen=True)
class Shapes:
    name: str
    tokens: int          # token-wise ops: tokens in a prefill chunk
    batch: int           # decode: sequences
    context: int         # decode: context length of each sequence
    block_size: int      # paged caches
    hidden: int
    heads: int
    d_qk: int
    d_v: int
    rope_dim: int
    index_heads: int
    index_dim: int
    index_topk: int
    experts: int
    top_k: int
    moe_intermediate: int
    local_experts: int   # grouped_gemm: the experts of one expert-parallel rank
    group_size: int      # INT4 weights
    attention_tokens: int  # indexer_logits / indexer_topk / sparse_mla_attention: a query chunk


def shapes(preset: str) -> Shapes:
    if preset not in PRESETS:
        from ...errors import HalError
        raise HalError(f"bench --preset: expected one of {list(PRESETS)}, got {preset!r}")
    if preset == "tiny":
        return Shapes("tiny", tokens=16, batch=2, context=300, block_size=16, hidden=64, heads=4, d_qk=72, d_v=64,
                      rope_dim=8, index_heads=4, index_dim=32, index_topk=64, experts=16, top_k=4,
                      moe_intermediate=32, local_experts=4, group_size=16, attention_tokens=4)
    g = GLM5
    return Shapes(preset, tokens=1024, batch=4, context=8192 if preset == "glm5" else 32768, block_size=64,
                  hidden=g.hidden_size, heads=g.num_heads, d_qk=g.d_qk, d_v=g.d_v, rope_dim=g.qk_rope_head_dim,
                  index_heads=g.index_n_heads, index_dim=g.index_head_dim, index_topk=g.index_topk,
                  experts=g.n_routed_experts, top_k=g.num_experts_per_tok, moe_intermediate=g.moe_intermediate_size,
                  local_experts=g.n_routed_experts // 16, group_size=128, attention_tokens=16)


# -- input helpers ---------------------------------------------------------------------------
def seeded(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, name)))


def randn(g: torch.Generator, shape, dtype=BF16, scale: float = 1.0) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype).normal_(generator=g)  # no float32 temporary at GB sizes
    return t.mul_(scale) if scale != 1.0 else t


def routing(g: torch.Generator, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """ids [T, k] int32: k distinct experts per token."""
    return torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.to(I32)


def paged(g: torch.Generator, batch: int, context: int, block_size: int, dim: int, dtype=BF16, fp8: bool = False):
    """(cache, block_table, context_lens): `batch` sequences of `context` tokens in shuffled blocks.
    fp8: the cache is an (float8_e4m3fn, float32 scale) pair (the indexer's key cache)."""
    per_seq = math.ceil(context / block_size)
    table = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).to(I32)
    lens = torch.full((batch,), context, dtype=I32)
    if fp8:
        values = randn(g, (batch * per_seq, block_size, dim), F32)
        scale = values.abs().amax(-1).clamp(min=1e-4) / 448
        return ((values / scale.unsqueeze(-1)).to(FP8), scale), table, lens
    return randn(g, (batch * per_seq, block_size, dim), dtype), table, lens


# -- the registry ----------------------------------------------------------------------------
_CASES: dict[str, Callable[[Shapes], "BenchCase | list[BenchCase]"]] = {}
_loaded = False


def bench_case(op: str) -> Callable:
    """Registers `fn(shapes) -> BenchCase | list[BenchCase]` as the benchmark cases of `op`."""
    def register(fn: Callable[[Shapes], BenchCase | list[BenchCase]]) -> Callable:
        if op in _CASES:
            from ...errors import HalError
            raise HalError(f"bench: op {op!r} has two cases ({_CASES[op].__module__} and {fn.__module__})")
        _CASES[op] = fn
        return fn
    return register


def cases(preset: str = "glm5", batch: int | None = None) -> list[BenchCase]:
    """The cases of every op for `preset`, family by family; `batch` overrides the decode batch
    (e.g. 64 sequences, the issue-14 sparse decode target)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
    s = shapes(preset) if batch is None else dataclasses.replace(shapes(preset), batch=batch)
    out = []
    for op, make in _CASES.items():
        made = make(s)
        out += [dataclasses.replace(c, op=op) for c in (made if isinstance(made, list) else [made])]
    return out
