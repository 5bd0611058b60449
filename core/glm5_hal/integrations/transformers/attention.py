"""HF transformers' GLM-MoE-DSA attention (`GlmMoeDsaAttention`) computed with glm5_hal ops.

HF's own forward expands every cached latent into per-head keys and values (`expand_kv`, a
`kv_b_proj` matmul over the whole context at every decode step) before calling the attention
function, which therefore never sees the latent. This forward replaces the module's instead,
and attends in absorbed (MQA) mode exactly like `glm5_hal.models`: the cached row of a token
is `cat(c_kv, rope(k_pe))`, the query `cat(q_nope @ W_UK, rope(q_pe))`, and the latent output
goes through `W_UV` and `o_proj`. It reads and writes HF's cache object (`cache.update`,
`cache.update_indexer`) in HF's layout, so `generate()` and its dynamic and static caches work
unchanged, and a cache filled by HF's eager forward can be continued by this one.

Per call: `rms_norm` (q_a / kv_a layernorms), `apply_rope`, the indexer's `indexer_topk` over
the cached indexer keys (a "full" layer) or the previous full layer's top-k (a "shared"
layer), then `sparse_mla_attention` over the cached rows. Plain torch does the projections,
the indexer's LayerNorm, the absorption matmuls and small reshapes. HF's indexer applies no
Hadamard rotation (scores are unchanged by it in exact arithmetic), and neither does this.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import ops as hal_ops
from ...errors import InvalidInputError
from ...reference.quant import fp8_block_dequantize

# Op calls go through this name so that `record_ops` can observe them (glm5_hal.models.trace).
ops = hal_ops

_OP = "glm5_hal attention (GlmMoeDsaAttention)"


def key_ranges_mask(*args, **kwargs) -> Tensor:
    """The mask function registered for "glm5_hal" in HF's AttentionMaskInterface: HF's SDPA
    mask (boolean [B, 1, S, T]: causal, padding, packing, static-cache length) reduced once per
    forward, instead of once per layer, to the form the DSA ops take: int32 [B, S, 2], the
    range `[start, end)` of cached keys that query s of batch row b attends to. One contiguous
    range per query covers left and right padding, packed sequences and static caches. A
    tensor, because generate() handles masks as tensors."""
    from transformers.masking_utils import sdpa_mask
    kwargs["allow_is_causal_skip"] = False
    return torch.stack(key_ranges(sdpa_mask(*args, **kwargs)), dim=-1)


def key_ranges(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(start, end), int32 [B, S] each, of a 4D mask [B, 1, S, T]: boolean (True attends) or
    additive float (0 attends). A mask whose allowed keys are not one contiguous range per
    query raises InvalidInputError (on accelerators: a device-side assert, no host sync)."""
    if not isinstance(mask, Tensor) or mask.dim() != 4 or mask.shape[1] != 1:
        raise InvalidInputError(_OP, "attention_mask", "a [B, 1, S, T] mask, or [B, S, 2] key ranges",
                                f"shape {list(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__)
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:
        allowed = mask[:, 0] == 0
        # an additive mask other than 0 / -inf (a bias such as ALiBi) is not a key range
        _require((allowed | (mask[:, 0] <= torch.finfo(mask.dtype).min / 2)).all(),
                 "an additive mask of 0 (attend) and the dtype's minimum (masked) only")
    t = allowed.shape[-1]
    anyone = allowed.any(-1)
    start = torch.where(anyone, allowed.int().argmax(-1), 0).to(torch.int32)
    end = torch.where(anyone, t - allowed.flip(-1).int().argmax(-1), 0).to(torch.int32)
    _require((allowed.sum(-1) == end - start).all(), "one contiguous range of keys per query (left or right "
             "padding, packed sequences); this mask has holes")
    return start, end


def _ranges(mask, batch: int, queries: int, keys: int, device) -> tuple[Tensor, Tensor]:
    """Per-query key ranges [B, S] from what the model passes as the mask: key_ranges_mask's
    ranges, a 4D mask, or None (plain causal: query s sees keys [0, T - S + s])."""
    if mask is None:
        end = torch.arange(keys - queries + 1, keys + 1, dtype=torch.int32, device=device).expand(batch, queries)
        return torch.zeros_like(end), end
    if isinstance(mask, Tensor) and mask.dtype == torch.int32 and mask.dim() == 3:
        start, end = mask.unbind(-1)
    else:
        start, end = key_ranges(mask)
    if tuple(start.shape) != (batch, queries):
        raise InvalidInputError(_OP, "attention_mask", f"ranges of [{batch}, {queries}] queries",
                                f"[{list(start.shape)}]")
    _require((end <= keys).all(), f"key ranges within the {keys} cached keys of each row")
    return start, end


def _require(ok: Tensor, expected: str) -> None:
    if ok.device.type == "cpu":
        if not bool(ok):
            raise InvalidInputError(_OP, "attention_mask", expected, "a mask that is not")
    else:
        torch._assert_async(ok, f"{_OP}: attention_mask must be {expected}")


def _rope(module, x: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor]) -> Tensor:
    """HF's interleaved rope (`apply_rotary_pos_emb_interleave`) of x [N, H, R], whose output
    lists the rotated even elements, then the rotated odd ones. With rope_type "default" it is
    apply_rope's half-split rotation of the de-interleaved x (same pairs, same angles);
    other rope types (scaled frequencies, attention factors) use HF's cos and sin."""
    params = module.config.rope_parameters
    deinterleaved = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    if params.get("rope_type", "default") == "default":
        return ops.apply_rope(deinterleaved, positions, float(params["rope_theta"]), False)
    half = x.shape[-1] // 2        # cos, sin: [1 or B, S, R], cat(freqs, freqs)
    cos, sin = (t[..., :half].expand(x.shape[0] // t.shape[-2], -1, -1).reshape(-1, 1, half) for t in cos_sin)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def _rope_slice(module, x: Tensor, positions: Tensor, cos_sin) -> Tensor:
    """Rope on the first qk_rope_head_dim dims of x [N, H, D] (the indexer's layout)."""
    r = module.qk_rope_head_dim
    return torch.cat([_rope(module, x[..., :r], positions, cos_sin), x[..., r:]], dim=-1)


def glm_moe_dsa_attention(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                          attention_mask=None, cache=None, position_ids: Tensor | None = None,
                          prev_topk_indices: Tensor | None = None, past_key_values=None,
                          **kwargs) -> tuple[Tensor, None, Tensor]:
    """`GlmMoeDsaAttention.forward` on glm5_hal ops (transformers 5.23 calls the cache
    `past_key_values`, 5.24 `cache`). Returns (output [B, S, hidden], None, top-k [B, S, topk]):
    the top-k in HF's form, key positions within each batch row, -1 padded, which the next
    layer reuses if it is "shared"."""
    cache = cache if cache is not None else past_key_values
    batch, queries, _ = hidden_states.shape
    tokens, heads = batch * queries, self.num_heads
    nope, rope, latent_dim = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    if position_ids is None:
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        position_ids = torch.arange(past, past + queries, device=hidden_states.device)
    positions = position_ids.expand(batch, queries).reshape(tokens)

    q_resid = ops.rms_norm(self.q_a_proj(hidden_states), self.q_a_layernorm.weight,
                           self.q_a_layernorm.variance_epsilon)
    q_nope, q_rot = self.q_b_proj(q_resid).view(tokens, heads, nope + rope).split([nope, rope], dim=-1)
    c_kv, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([latent_dim, rope], dim=-1)
    c_kv = ops.rms_norm(c_kv, self.kv_a_layernorm.weight, self.kv_a_layernorm.variance_epsilon)
    q_rot = _rope(self, q_rot, positions, position_embeddings)
    k_rot = _rope(self, k_rot.reshape(tokens, 1, rope), positions, position_embeddings)
    c_kv, k_rot = c_kv.view(batch, 1, queries, latent_dim), k_rot.view(batch, 1, queries, rope)
    if cache is not None:     # HF's layout: latents as the "keys", roped k_pe as the "values"
        c_kv, k_rot = cache.update(c_kv, k_rot, self.layer_idx, kwargs=kwargs)
    keys = c_kv.shape[2]
    rows = torch.cat([c_kv, k_rot], dim=-1).view(batch * keys, latent_dim + rope)

    start, end = _ranges(attention_mask, batch, queries, keys, rows.device)
    offsets = (torch.arange(batch, device=rows.device, dtype=torch.int32) * keys).unsqueeze(1)
    k_start, k_end = (start + offsets).reshape(tokens), (end + offsets).reshape(tokens)

    if self.indexer is not None:
        top = _indexer_topk(self, hidden_states, q_resid, positions, position_embeddings, cache, k_start, k_end)
    elif prev_topk_indices is None:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
    else:
        # HF's form back to rows; entries outside the query's range are dropped (-1)
        flat = prev_topk_indices.reshape(tokens, -1) + offsets.repeat_interleave(queries, 0)
        valid = (prev_topk_indices.reshape(tokens, -1) >= 0) & (flat >= k_start[:, None]) & (flat < k_end[:, None])
        top = torch.where(valid, flat, -1).to(torch.int32)

    w_uk, w_uv = _absorption_weight(self, q_nope.dtype).view(heads, nope + self.v_head_dim, latent_dim).split(
        [nope, self.v_head_dim], dim=1)
    query = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rot], dim=-1)
    latent, _ = ops.sparse_mla_attention(query, rows, top, self.scaling, latent_dim)      # [N, H, latent]
    out = torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)          # [N, H, v]
    out = self.o_proj(out.reshape(batch, queries, heads * self.v_head_dim))
    local = torch.where(top >= 0, top - offsets.repeat_interleave(queries, 0), -1)
    return out, None, local.view(batch, queries, -1)


def _absorption_weight(self, dtype: torch.dtype) -> Tensor:
    """kv_b_proj's weight [H * (nope + v), kv_lora], the source of W_UK and W_UV. An FP8
    checkpoint's (transformers' FP8Linear: float8_e4m3fn with 128 x 128 block scales
    `weight_scale_inv`, which multiply) is dequantized to the activations' dtype once and
    kept, as serving engines do for MLA absorption (a matmul with the latent, not a linear
    layer, so no FP8 GEMM applies)."""
    linear = self.kv_b_proj
    weight = linear.weight
    if weight.element_size() > 1:
        return weight
    scale, block = getattr(linear, "weight_scale_inv", None), list(getattr(linear, "block_size", None) or ())
    if weight.dtype != torch.float8_e4m3fn or scale is None or scale.dtype != torch.float32 or block != [128, 128]:
        raise InvalidInputError(_OP, "kv_b_proj", "a float weight, or float8_e4m3fn with float32 128 x 128 block "
                                "scales", f"{weight.dtype} weight, block {block or None}")
    key = (weight.data_ptr(), weight._version, scale._version, dtype)
    cached = self.__dict__.get("_glm5_hal_kv_b")
    if cached is None or cached[0] != key:
        cached = (key, fp8_block_dequantize(weight, scale).to(dtype))
        self.__dict__["_glm5_hal_kv_b"] = cached
    return cached[1]


def _indexer_topk(self, hidden_states: Tensor, q_resid: Tensor, positions: Tensor, cos_sin, cache,
                  k_start: Tensor, k_end: Tensor) -> Tensor:
    """The lightning indexer of a "full" layer: its queries against every cached indexer
    key, top-k per query within its range (rows of the flattened cache)."""
    ix = self.indexer
    batch, queries, _ = hidden_states.shape
    tokens, heads, dim = batch * queries, ix.n_heads, ix.head_dim
    q = _rope_slice(self, ix.wq_b(q_resid).view(tokens, heads, dim), positions, cos_sin)
    k = _rope_slice(self, ix.k_norm(ix.wk(hidden_states)).view(tokens, 1, dim), positions, cos_sin)
    k = k.view(batch, queries, dim)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    # HF: relu(q.k * D^-0.5) weighted by weights_proj(x) * Hi^-0.5; the scale moves into the weights
    weights = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float().view(tokens, heads)
    return ops.indexer_topk(q, k.reshape(-1, dim), weights * (heads ** -0.5 * ix.softmax_scale),
                            k_start, k_end, ix.index_topk)


def unsupported_attention(module, *args, **kwargs):
    """What HF's AttentionInterface holds for "glm5_hal": only GLM-MoE-DSA attention modules
    are served (their forward is replaced, so this is never reached for them)."""
    raise InvalidInputError("glm5_hal attention", "module",
                            "a transformers GlmMoeDsaAttention (model_type 'glm_moe_dsa')", type(module).__name__)
