"""Benchmark cases of the DSA ops: the indexer and sparse attention over a query chunk, and
decode of the batch at the preset's context (the sparse decode and paged top-k targets)."""
from __future__ import annotations

import torch

from ...presets import GLM5_SM_SCALE
from ..runner import BenchCase
from . import F32, I32, Shapes, bench_case, paged, randn, seeded


def _decode(s: Shapes) -> str:
    return f"B={s.batch} ctx={s.context}"


def _indexer(s: Shapes, with_topk: bool):
    Tq, Hi, Di, ctx = s.attention_tokens, s.index_heads, s.index_dim, s.context

    def make():
        g = seeded("idx")
        q = randn(g, (Tq, Hi, Di))
        keys = randn(g, (ctx, Di))
        w = randn(g, (Tq, Hi), F32, (Hi * Di) ** -0.5)
        end = torch.arange(ctx - Tq + 1, ctx + 1, dtype=I32)   # the last Tq positions, causal
        args = (q, keys, w, torch.zeros(Tq, dtype=I32), end)
        return (*args, s.index_topk) if with_topk else args
    return make


def _indexer_work(s: Shapes) -> dict:
    Tq, Hi, Di, ctx = s.attention_tokens, s.index_heads, s.index_dim, s.context
    return dict(flops=2 * Tq * Hi * Di * ctx, nbytes=2 * ctx * Di + 4 * Tq * ctx, compute="bf16")


@bench_case("indexer_logits")
def indexer_logits(s: Shapes) -> BenchCase:
    return BenchCase(f"[{s.attention_tokens}, {s.index_heads}, {s.index_dim}] x {s.context} keys bf16",
                     _indexer(s, False), **_indexer_work(s))


@bench_case("indexer_topk")
def indexer_topk(s: Shapes) -> BenchCase:
    return BenchCase(f"[{s.attention_tokens}, {s.index_heads}, {s.index_dim}] x {s.context} keys "
                     f"top-{s.index_topk}", _indexer(s, True), **_indexer_work(s))


@bench_case("indexer_topk_paged")
def indexer_topk_paged(s: Shapes) -> BenchCase:
    B, Hi, Di, ctx = s.batch, s.index_heads, s.index_dim, s.context

    def make():
        g = seeded("idxp")
        cache, table, lens = paged(g, B, ctx, s.block_size, Di, fp8=True)
        q = randn(g, (B, 1, Hi, Di))
        return q, cache, randn(g, (B, 1, Hi), F32, (Hi * Di) ** -0.5), table, lens, s.index_topk

    return BenchCase(f"{_decode(s)} {Hi}x{Di} fp8 keys top-{s.index_topk}", make,
                     flops=2 * B * Hi * Di * ctx, nbytes=B * ctx * (Di + 4), compute="bf16")


def _attention_flops(s: Shapes) -> int:
    """Multiply-adds per (query head, selected row): q . row over d_qk, p * row over d_v. Held
    to the machine's bf16 rate (compute="bf16"): QK is bf16 x bf16, and the fastest rate is the
    limit that cannot be beaten (PV's float32 probabilities would allow less)."""
    return s.d_qk + s.d_v


@bench_case("sparse_mla_attention")
def sparse_mla_attention(s: Shapes) -> BenchCase:
    Tq, ctx, topk = s.attention_tokens, s.context, min(s.index_topk, s.context)

    def make():
        g = seeded("sparse")
        q = randn(g, (Tq, s.heads, s.d_qk))
        kv = randn(g, (ctx, s.d_qk))
        idx = torch.rand(Tq, ctx, generator=g).topk(topk, dim=-1).indices.to(I32)
        return q, kv, idx, GLM5_SM_SCALE, s.d_v

    return BenchCase(f"[{Tq}, {s.heads}, {s.d_qk}] top-{s.index_topk} of {ctx}", make,
                     flops=2 * Tq * s.heads * topk * _attention_flops(s), nbytes=2 * Tq * topk * s.d_qk,
                     compute="bf16")


def _decode_inputs(s: Shapes, sparse: bool):
    B, ctx = s.batch, s.context

    def make():
        g = seeded("decode")
        cache, table, lens = paged(g, B, ctx, s.block_size, s.d_qk)
        q = randn(g, (B, 1, s.heads, s.d_qk))
        if not sparse:
            return q, cache, table, lens, GLM5_SM_SCALE, s.d_v
        idx = torch.rand(B, ctx, generator=g).topk(min(s.index_topk, ctx), dim=-1).indices.to(I32).view(B, 1, -1)
        return q, cache, table, lens, idx, GLM5_SM_SCALE, s.d_v
    return make


@bench_case("sparse_mla_decode_paged")
def sparse_mla_decode_paged(s: Shapes) -> BenchCase:
    B, topk = s.batch, min(s.index_topk, s.context)
    return BenchCase(f"{_decode(s)} H={s.heads} top-{s.index_topk} bf16", _decode_inputs(s, True),
                     flops=2 * B * s.heads * topk * _attention_flops(s), nbytes=2 * B * topk * s.d_qk,
                     compute="bf16")


@bench_case("dense_mla_decode_paged")
def dense_mla_decode_paged(s: Shapes) -> BenchCase:
    B, ctx = s.batch, s.context
    # compiling the dense reference at long contexts takes minutes and gigabytes
    return BenchCase(f"{_decode(s)} H={s.heads} bf16", _decode_inputs(s, False),
                     flops=2 * B * s.heads * ctx * _attention_flops(s), nbytes=2 * B * ctx * s.d_qk,
                     compute="bf16", compile_reference=ctx <= 8192)
