"""The layers of a GLM-5-architecture model, computed with `glm5_hal.ops` (plus plain torch for
embeddings, linear projections and the indexer's LayerNorm).

Module and parameter names follow HF transformers' `glm_moe_dsa` (GlmMoeDsaForCausalLM), so
a state dict of that model loads by name (docs/models.md lists what was checked).

Attention runs in absorbed (MQA) mode over one paged latent cache per layer whose rows are
`cat(c_kv, rope(k_pe))`: the absorbed query `cat(q_nope @ W_UK, rope(q_pe))` scores a row
exactly as the expanded per-head key `cat(W_UK c_kv, rope(k_pe))` would, and the latent
output goes through W_UV and o_proj.
"""
from __future__ import annotations

from typing import NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops as hal_ops
from ..errors import InvalidInputError
from .config import GLM5Config

# Every op call below goes through this name so that `trace.record_ops()` can observe which
# ops a forward pass calls, with what arguments (the demo explains their dispatch).
ops = hal_ops

#: An indexer key cache: [num_blocks, block_size, index_head_dim] in the model's dtype, or the
#: FP8 pair (float8_e4m3fn [num_blocks, block_size, index_head_dim], float32 [num_blocks, block_size]).
IndexCache = Union[Tensor, "tuple[Tensor, Tensor]"]


class LayerCache(NamedTuple):
    """One layer's paged caches (block geometry shared by every layer)."""
    kv: Tensor                      # [num_blocks, block_size, d_qk]: rows cat(c_kv, k_pe)
    index_keys: IndexCache | None   # None when the layer runs no indexer (dense, or "shared")


class Step(NamedTuple):
    """What every layer needs to know about the tokens of one forward pass.

    Tokens are packed: T new tokens of B sequences, sequence by sequence. A decode step has
    exactly one new token per sequence (T == B) and no k ranges; a packed prefill has any
    number per sequence and gives each token its key range within the sequences' context
    rows gathered from the cache and concatenated in batch order.
    """
    positions: Tensor               # int32 [T]: position of each new token in its sequence
    slot_mapping: Tensor            # int32 [T]: the cache slot each new token is written to
    block_table: Tensor             # int32 [B, max_blocks]
    context_lens: Tensor            # int32 [B]: tokens held after this step (new ones included)
    k_start: Tensor | None = None   # prefill: int32 [T], first gathered row a token sees
    k_end: Tensor | None = None     # prefill: int32 [T], one past the last (causal)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers' `mlp` and the MoE layers' `mlp.shared_experts`."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu_and_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))


class Router(nn.Module):
    """`mlp.gate`: router weight and the score correction bias (selection only)."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: Tensor) -> Tensor:
        # router logits in float32, as HF and DeepSeek-V3.2 compute them
        return F.linear(x.float(), self.weight)

    def _apply(self, fn, recurse=True):
        # Both stay float32 whatever the model dtype, as HF keeps them
        # (_keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]): they decide
        # expert selection, where a bf16 rounding would flip near choices, and a float32 checkpoint
        # tensor loads exactly.
        # .data: _apply may swap the parameter's data in place, the old tensor keeps the float32 values
        weight, bias = self.weight.data, self.e_score_correction_bias
        module = super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight.data = weight.to(device=self.weight.device, dtype=torch.float32)
        moved = self.e_score_correction_bias
        if moved.dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return module


#: How the per-expert checkpoint tensors sit in the stacked ones: (checkpoint projection, stacked
#: tensor, which half of its rows: 0 gate, 1 up, None all).
EXPERT_PROJECTIONS = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
                      ("down_proj", "down_proj", None))


class Experts(nn.Module):
    """`mlp.experts`: routed expert weights stacked in grouped_gemm's [E, N, K] layout.

    `gate_up_proj` [E, 2I, H] holds each expert's gate rows then up rows (so silu_and_mul
    splits them), `down_proj` [E, H, I]; these are also HF transformers' in-memory names.
    `state_dict()` writes the checkpoint layout instead, one module per expert
    (`experts.{e}.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`), and
    `load_state_dict()` accepts either layout. The quantized forms (`quantized.Fp8Experts`,
    `quantized.Int8Experts`) keep the same layout plus per-tensor scales.
    """
    #: checkpoint tensor suffix -> suffix of the stacked tensor it is a slice of
    CHECKPOINT_SUFFIXES = {"weight": ""}

    def __init__(self, config: GLM5Config):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size = e, i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        register_checkpoint_layout(self)

    def forward(self, rows: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """Rows grouped by expert (moe_permute) -> down_proj(silu(gate) * up) of each row's expert."""
        hidden = ops.silu_and_mul(ops.grouped_gemm(rows, self.gate_up_proj, tokens_per_expert))
        return ops.grouped_gemm(hidden, self.down_proj, tokens_per_expert)


def register_checkpoint_layout(experts: nn.Module) -> None:
    """state_dict() in the per-expert checkpoint layout; load_state_dict() takes it or the stacked one."""
    experts.register_state_dict_post_hook(_experts_to_checkpoint_layout)
    experts.register_load_state_dict_pre_hook(_experts_from_checkpoint_layout)


def expert_views(experts: nn.Module, prefix: str = ""):
    """(checkpoint name, view) of every per-expert tensor: `{prefix}{e}.{gate,up,down}_proj.{suffix}`
    as a view of the stacked tensor it is part of (no copy)."""
    for e in range(experts.num_experts):
        for projection, stacked, half in EXPERT_PROJECTIONS:
            for suffix, stacked_suffix in experts.CHECKPOINT_SUFFIXES.items():
                tensor = getattr(experts, stacked + stacked_suffix)[e]
                yield f"{prefix}{e}.{projection}.{suffix}", tensor if half is None else tensor.chunk(2)[half]


def _experts_to_checkpoint_layout(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    stacked = [prefix + name + suffix for name in ("gate_up_proj", "down_proj")
               for suffix in module.CHECKPOINT_SUFFIXES.values()]
    if not all(name in state_dict for name in stacked):  # a dict already rewritten or filtered: leave it
        return
    for name in stacked:
        del state_dict[name]
    for name, view in expert_views(module, prefix):
        # clones: per-expert tensors must not share storage (torch.save keeps the whole storage)
        state_dict[name] = view.detach().clone()


def _experts_from_checkpoint_layout(module: nn.Module, state_dict, prefix: str, *args) -> None:
    names = [name for name, _ in expert_views(module, prefix)]
    if not all(name in state_dict for name in names):
        return  # stacked layout, or an incomplete one: load_state_dict reports what is missing
    for suffix, stacked_suffix in module.CHECKPOINT_SUFFIXES.items():
        per_expert = [{p: state_dict.pop(f"{prefix}{e}.{p}.{suffix}") for p, _, _ in EXPERT_PROJECTIONS}
                      for e in range(module.num_experts)]
        state_dict[prefix + "gate_up_proj" + stacked_suffix] = torch.stack(
            [torch.cat([t["gate_proj"], t["up_proj"]], dim=0) for t in per_expert])
        state_dict[prefix + "down_proj" + stacked_suffix] = torch.stack([t["down_proj"] for t in per_expert])


class MoE(nn.Module):
    """Routed experts (sigmoid routing with correction bias) plus the shared expert."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        self.config = config
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def forward(self, x: Tensor) -> Tensor:
        c = self.config
        weights, ids = ops.moe_route(self.gate(x), self.gate.e_score_correction_bias, c.num_experts_per_tok,
                                     c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob,
                                     "sigmoid")
        rows, tokens_per_expert, src = ops.moe_permute(x, ids, c.n_routed_experts)
        out = ops.moe_unpermute(self.experts(rows, tokens_per_expert), src, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Indexer(nn.Module):
    """`self_attn.indexer`: the DSA lightning indexer's projections (docs/ops/dsa.md, indexer_logits)."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        self.config = config
        heads, dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=config.indexer_norm_eps)
        self.weights_proj = nn.Linear(config.hidden_size, heads, bias=False)

    def forward(self, x: Tensor, q_latent: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Indexer queries [T, Hi, D], keys [T, D] and head weights [T, Hi] float32 with
        every scale folded in (Hi^-0.5, D^-0.5 and, with FP8, the query scale)."""
        c = self.config
        heads, dim = c.index_n_heads, c.index_head_dim
        q = self._rope(self.wq_b(q_latent).view(-1, heads, dim), positions)
        k = self._rope(self.k_norm(self.wk(x)).unsqueeze(1), positions).squeeze(1)
        # The Hadamard rotation is orthonormal (dot products unchanged); it spreads outliers
        # across dims before FP8 quantization.
        q = ops.hadamard_transform(q, dim ** -0.5)
        k = ops.hadamard_transform(k, dim ** -0.5)
        weights = self.weights_proj(x).float() * (heads ** -0.5 * dim ** -0.5)
        if c.indexer_fp8:
            q_fp8, q_scale = ops.fp8_block_quant(q, dim, c.indexer_scale_fmt)
            # relu(s * q8 . k) = s * relu(q8 . k) for s > 0: the scale moves into the weights
            q, weights = q_fp8.to(q.dtype), weights * q_scale.squeeze(-1)
        return q, k, weights

    def _rope(self, t: Tensor, positions: Tensor) -> Tensor:
        """Rope on the first qk_rope_head_dim dims of each head, the rest unchanged."""
        c = self.config
        r = c.qk_rope_head_dim
        roped = ops.apply_rope(t[..., :r], positions, c.rope_theta, c.indexer_rope_interleaved)
        return torch.cat([roped, t[..., r:]], dim=-1)


def write_index_keys(keys: Tensor, cache: IndexCache, slot_mapping: Tensor, scale_fmt: str | None) -> None:
    if isinstance(cache, tuple):
        ops.indexer_k_cache_write(keys, cache[0], cache[1], slot_mapping, scale_fmt)
    else:
        ops.kv_cache_write(cache, keys, slot_mapping)


class MLAAttention(nn.Module):
    """`self_attn`: multi-head latent attention with the DSA indexer. A layer whose
    `indexer_types` entry is "shared" has no indexer (as in HF) and attends to the top-k
    of the previous full layer."""

    def __init__(self, config: GLM5Config, layer: int):
        super().__init__()
        self.config = config
        c = config
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.lora_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.lora_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.indexer = None if c.shares_topk(layer) else Indexer(c)

    def forward(self, x: Tensor, step: Step, cache: LayerCache,
                shared_top: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The attention output [T, hidden] and the top-k this layer attended to (None when
        dense), which the next layer reuses if it is "shared". `shared_top` is that top-k
        from the previous layer: decode [B, 1, topk] logical positions, prefill [T, topk]
        rows of the gathered context."""
        c = self.config
        tokens = x.shape[0]
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_pe = self.q_b_proj(q_latent).view(tokens, c.num_heads, c.qk_head_dim).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_pe = ops.apply_rope(q_pe, step.positions, c.rope_theta, c.rope_interleaved)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = ops.apply_rope(k_pe.unsqueeze(1), step.positions, c.rope_theta, c.rope_interleaved).squeeze(1)
        ops.kv_cache_write(cache.kv, torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1), step.slot_mapping)

        # An FP8 kv_b_proj (quantized.Fp8Linear) keeps its weight dequantized as dense_weight: absorption
        # multiplies it into the query and the latent output, no linear layer runs on it.
        kv_b = getattr(self.kv_b_proj, "dense_weight", None)
        kv_b = self.kv_b_proj.weight if kv_b is None else kv_b
        w_uk, w_uv = kv_b.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank).split(
            [c.qk_nope_head_dim, c.v_head_dim], dim=1)
        query = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe], dim=-1)   # [T, H, d_qk]

        index = None
        if c.attention == "sparse" and self.indexer is not None:
            index = self.indexer(x, q_latent, step.positions)
            write_index_keys(index[1], cache.index_keys, step.slot_mapping, c.indexer_scale_fmt)
        if c.attention == "sparse" and index is None and shared_top is None:
            raise InvalidInputError("MLAAttention", "shared_top", "the top-k of the previous full layer "
                                    "(this layer's indexer_types entry is 'shared')", None)
        if step.k_start is None:
            latent, top = self._decode(query, index, shared_top, step, cache)
        else:
            latent, top = self._prefill(query, index, shared_top, step, cache)
        out = torch.einsum("thc,hvc->thv", latent, w_uv)                                # [T, H, v]
        return self.o_proj(out.reshape(tokens, c.num_heads * c.v_head_dim)), top

    def _decode(self, query: Tensor, index, top: Tensor | None, step: Step,
                cache: LayerCache) -> tuple[Tensor, Tensor | None]:
        """One new token per sequence, attending through the block tables."""
        c = self.config
        query = query.unsqueeze(1)                                                      # [B, 1, H, d_qk]
        if c.attention == "dense":
            out, _ = ops.dense_mla_decode_paged(query, cache.kv, step.block_table, step.context_lens,
                                                c.sm_scale, c.d_v)
            return out.squeeze(1), None
        if index is not None:
            q, _, weights = index
            top = ops.indexer_topk_paged(q.unsqueeze(1), cache.index_keys, weights.unsqueeze(1),
                                         step.block_table, step.context_lens, c.index_topk)
        out, _ = ops.sparse_mla_decode_paged(query, cache.kv, step.block_table, step.context_lens,
                                             top, c.sm_scale, c.d_v)
        return out.squeeze(1), top

    def _prefill(self, query: Tensor, index, top: Tensor | None, step: Step,
                 cache: LayerCache) -> tuple[Tensor, Tensor | None]:
        """Any number of new tokens per sequence: the sequences' rows (cached context and
        the rows just written) are gathered once and each token attends within its range.
        The gathered rows are in the same order in every layer, so a shared layer's top-k
        indexes its own rows."""
        c = self.config
        rows = ops.kv_cache_gather(cache.kv, step.block_table, step.context_lens)      # [S, d_qk]
        if c.attention == "dense":
            span = int((step.k_end - step.k_start).max())
            candidates = step.k_start.unsqueeze(1) + torch.arange(span, device=query.device, dtype=torch.int32)
            out, _ = ops.sparse_mla_attention(query, rows, torch.where(candidates < step.k_end.unsqueeze(1),
                                                                       candidates, -1), c.sm_scale, c.d_v)
            return out, None
        if index is not None:
            q, _, weights = index
            top = ops.indexer_topk(q, self._gathered_index_keys(cache.index_keys, step), weights,
                                   step.k_start, step.k_end, c.index_topk)
        out, _ = ops.sparse_mla_attention(query, rows, top, c.sm_scale, c.d_v)
        return out, top

    @staticmethod
    def _gathered_index_keys(cache: IndexCache, step: Step):
        if isinstance(cache, tuple):
            keys = ops.kv_cache_gather(cache[0], step.block_table, step.context_lens)
            scales = ops.kv_cache_gather(cache[1].unsqueeze(-1), step.block_table, step.context_lens)
            return keys, scales.squeeze(-1)
        return ops.kv_cache_gather(cache, step.block_table, step.context_lens)


class DecoderLayer(nn.Module):
    def __init__(self, config: GLM5Config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(layer) else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor, step: Step, cache: LayerCache,
                shared_top: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The layer's output and its attention top-k (see `MLAAttention.forward`)."""
        attended, top = self.self_attn(self.input_layernorm(x), step, cache, shared_top)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), top
