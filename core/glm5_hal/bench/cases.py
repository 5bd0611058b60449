"""Benchmark cases: every op at GLM-5 shapes (OPS.md section 1).

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
import math

import torch

from ..presets import GLM5, GLM5_SM_SCALE
from .runner import BenchCase

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
        from ..errors import HalError
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
def _gen(name: str) -> torch.Generator:
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


# -- cases -----------------------------------------------------------------------------------
def cases(preset: str = "glm5") -> list[BenchCase]:
    s = shapes(preset)
    T, H, E, k = s.tokens, s.hidden, s.experts, s.top_k
    M = T * k                                        # routed rows
    I = s.moe_intermediate
    B, ctx, bs = s.batch, s.context, s.block_size
    Hi, Di, topk = s.index_heads, s.index_dim, s.index_topk
    Tq = s.attention_tokens
    decode = f"B={B} ctx={ctx}"
    out = []

    def case(op, label, make, flops=0.0, nbytes=0.0, compile_reference=True):
        out.append(BenchCase(op, label, make, float(flops), float(nbytes), compile_reference))

    # elementwise
    case("rms_norm", f"[{T}, {H}] bf16",
         lambda: (randn(_gen("rms"), (T, H)), randn(_gen("rms-w"), (H,)), GLM5.rms_norm_eps), nbytes=4 * T * H)
    case("silu_and_mul", f"[{M}, {2 * I}] bf16", lambda: (randn(_gen("silu"), (M, 2 * I)),), nbytes=6 * M * I)
    case("apply_rope", f"[{T}, {s.heads}, {s.rope_dim}] bf16",
         lambda: (randn(_gen("rope"), (T, s.heads, s.rope_dim)), torch.arange(ctx, ctx + T), GLM5.rope_theta, True),
         nbytes=4 * T * s.heads * s.rope_dim)
    case("hadamard_transform", f"[{T}, {Hi}, {Di}] bf16",
         lambda: (randn(_gen("had"), (T, Hi, Di)), Di ** -0.5), nbytes=4 * T * Hi * Di)

    # quantization
    case("fp8_block_quant", f"[{T}, {H}] bf16 block 128 ue8m0",
         lambda: (randn(_gen("fp8"), (T, H)), 128 if H % 128 == 0 else H, "ue8m0"), nbytes=3 * T * H + T * H // 32)
    n_w, k_w, gsz = 2 * I, H, s.group_size
    case("int4_fake_quant", f"[{n_w}, {k_w}] bf16 g{gsz}", lambda: (randn(_gen("i4"), (n_w, k_w)), gsz),
         nbytes=4 * n_w * k_w)
    case("int4_pack", f"[{n_w}, {k_w}] bf16 g{gsz}", lambda: (randn(_gen("i4"), (n_w, k_w)), gsz),
         nbytes=2.5 * n_w * k_w)

    def packed_weight():
        from .. import reference
        packed, scale = reference.int4_pack(randn(_gen("i4"), (n_w, k_w)), gsz)
        return packed, scale

    case("int4_unpack", f"[{n_w}, {k_w // 8}] int32 g{gsz}", lambda: (*packed_weight(), gsz), nbytes=4.5 * n_w * k_w)
    m_w = min(T, 128)
    case("w4a16_gemm", f"[{m_w}, {k_w}] x [{n_w}, {k_w}] int4", lambda: (randn(_gen("w4x"), (m_w, k_w)), *packed_weight(), gsz),
         flops=2 * m_w * n_w * k_w, nbytes=0.5 * n_w * k_w + 2 * m_w * (k_w + n_w))

    # MoE
    case("moe_route", f"[{T}, {E}] fp32 top-{k}",
         lambda: (randn(_gen("route"), (T, E), F32), randn(_gen("bias"), (E,), F32, 0.01), k, GLM5.n_group,
                  GLM5.topk_group, GLM5.routed_scaling_factor, True, "sigmoid"), nbytes=4 * T * E)
    case("moe_permute", f"[{T}, {H}] bf16 top-{k} of {E}",
         lambda: (randn(_gen("perm"), (T, H)), routing(_gen("ids"), T, E, k), E), nbytes=4 * M * H)

    def unpermute_inputs():
        from .. import reference
        _, _, src = reference.moe_permute(torch.empty(T, 0, dtype=BF16), routing(_gen("ids"), T, E, k), E)
        return randn(_gen("unperm"), (M, H)), src, torch.rand(T, k, generator=_gen("w"))

    case("moe_unpermute", f"[{M}, {H}] bf16 -> [{T}, {H}]", unpermute_inputs, nbytes=2 * M * H + 2 * T * H)
    el, ml = s.local_experts, max(1, M * s.local_experts // E)

    def grouped_inputs():
        g = _gen("gg")
        counts = torch.bincount(torch.randint(0, el, (ml,), generator=g), minlength=el).to(I32)
        return randn(g, (ml, H)), randn(g, (el, 2 * I, H), BF16, H ** -0.5), counts

    case("grouped_gemm", f"{el} experts, [{ml}, {H}] x [{2 * I}, {H}] bf16", grouped_inputs,
         flops=2 * ml * 2 * I * H, nbytes=2 * el * 2 * I * H + 2 * ml * (H + 2 * I))

    # paged KV
    slots_total = B * math.ceil(ctx / bs) * bs

    def kv_write_inputs():
        g = _gen("kvw")
        cache, _, _ = paged(g, B, ctx, bs, s.d_qk)
        return cache, randn(g, (T, s.d_qk)), torch.randperm(slots_total, generator=g)[:T].to(I32)

    case("kv_cache_write", f"{T} rows of {s.d_qk} bf16 into {decode}", kv_write_inputs, nbytes=4 * T * s.d_qk)

    def indexer_write_inputs():
        g = _gen("ikw")
        (kc, ksc), _, _ = paged(g, B, ctx, bs, Di, fp8=True)
        return randn(g, (T, Di)), kc, ksc, torch.randperm(slots_total, generator=g)[:T].to(I32), "ue8m0"

    case("indexer_k_cache_write", f"{T} keys of {Di} bf16 -> fp8", indexer_write_inputs, nbytes=T * Di * 3 + 4 * T)
    case("kv_cache_gather", f"{decode} rows of {s.d_qk} bf16", lambda: paged(_gen("gather"), B, ctx, bs, s.d_qk),
         nbytes=4 * B * ctx * s.d_qk)

    # DSA
    def indexer_inputs(with_topk: bool):
        def make():
            g = _gen("idx")
            q = randn(g, (Tq, Hi, Di))
            keys = randn(g, (ctx, Di))
            w = randn(g, (Tq, Hi), F32, (Hi * Di) ** -0.5)
            end = torch.arange(ctx - Tq + 1, ctx + 1, dtype=I32)   # the last Tq positions, causal
            args = (q, keys, w, torch.zeros(Tq, dtype=I32), end)
            return (*args, topk) if with_topk else args
        return make

    idx_flops, idx_bytes = 2 * Tq * Hi * Di * ctx, 2 * ctx * Di + 4 * Tq * ctx
    case("indexer_logits", f"[{Tq}, {Hi}, {Di}] x {ctx} keys bf16", indexer_inputs(False), idx_flops, idx_bytes)
    case("indexer_topk", f"[{Tq}, {Hi}, {Di}] x {ctx} keys top-{topk}", indexer_inputs(True), idx_flops, idx_bytes)

    def indexer_paged_inputs():
        g = _gen("idxp")
        cache, table, lens = paged(g, B, ctx, bs, Di, fp8=True)
        q = randn(g, (B, 1, Hi, Di))
        return q, cache, randn(g, (B, 1, Hi), F32, (Hi * Di) ** -0.5), table, lens, topk

    case("indexer_topk_paged", f"{decode} {Hi}x{Di} fp8 keys top-{topk}", indexer_paged_inputs,
         flops=2 * B * Hi * Di * ctx, nbytes=B * ctx * (Di + 4))
    attn = s.d_qk + s.d_v

    def sparse_inputs():
        g = _gen("sparse")
        q = randn(g, (Tq, s.heads, s.d_qk))
        kv = randn(g, (ctx, s.d_qk))
        idx = torch.rand(Tq, ctx, generator=g).topk(min(topk, ctx), dim=-1).indices.to(I32)
        return q, kv, idx, GLM5_SM_SCALE, s.d_v

    case("sparse_mla_attention", f"[{Tq}, {s.heads}, {s.d_qk}] top-{topk} of {ctx}", sparse_inputs,
         flops=2 * Tq * s.heads * min(topk, ctx) * attn, nbytes=2 * Tq * min(topk, ctx) * s.d_qk)

    def decode_inputs(sparse: bool):
        def make():
            g = _gen("decode")
            cache, table, lens = paged(g, B, ctx, bs, s.d_qk)
            q = randn(g, (B, 1, s.heads, s.d_qk))
            if not sparse:
                return q, cache, table, lens, GLM5_SM_SCALE, s.d_v
            idx = torch.rand(B, ctx, generator=g).topk(min(topk, ctx), dim=-1).indices.to(I32).view(B, 1, -1)
            return q, cache, table, lens, idx, GLM5_SM_SCALE, s.d_v
        return make

    case("sparse_mla_decode_paged", f"{decode} H={s.heads} top-{topk} bf16", decode_inputs(True),
         flops=2 * B * s.heads * min(topk, ctx) * attn, nbytes=2 * B * min(topk, ctx) * s.d_qk)
    # compiling the dense reference at long contexts takes minutes and gigabytes
    case("dense_mla_decode_paged", f"{decode} H={s.heads} bf16", decode_inputs(False),
         flops=2 * B * s.heads * ctx * attn, nbytes=2 * B * ctx * s.d_qk, compile_reference=ctx <= 8192)
    return out
