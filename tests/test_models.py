"""glm5_hal.models: the tiny GLM-5-architecture model composes the hal ops correctly.

The independent check is `_plain_logits`: the HF `glm_moe_dsa` forward written here in plain
torch (expanded per-head keys and values, no absorption, no cache, no Hadamard, DSA as a
mask over full attention, a per-token loop over experts). Everything else compares the
model's own paths with each other: incremental paged decode vs recomputation, packed
prefill vs token by token, batched vs alone, sparse vs dense, compiled vs eager, the
reference backend vs the default ones.
"""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import glm5_hal as hal
from glm5_hal import cli
from glm5_hal.kv import OutOfBlocksError
from glm5_hal.models import GLM5Cache, GLM5Config, GLM5ForCausalLM, LayerCache, record_ops

# one thread (conftest): the tiny model's matrices are too small to gain from intra-op threads,
# and two threads per pytest-xdist worker oversubscribe a small machine (measured here: 6 ms per
# decode step with one thread, 240 ms with two while other work shares the cores)
pytestmark = [pytest.mark.filterwarnings("ignore::glm5_hal.FallbackWarning"),
              pytest.mark.usefixtures("one_thread")]

TINY = GLM5Config.tiny()
FP8 = GLM5Config.tiny(indexer_fp8=True)
FP8_UE8M0 = GLM5Config.tiny(indexer_fp8=True, indexer_scale_fmt="ue8m0")
DENSE = GLM5Config.tiny(attention="dense")
# DeepSeek-V3.2-style routing (group-limited) and half-split indexer rope, through the same code
GROUPED = GLM5Config.tiny(n_group=4, topk_group=2, num_experts_per_tok=3, indexer_rope_interleaved=False)
# GLM-5.x cross-layer top-k sharing: layers 1 and 2 reuse layer 0's top-k, layer 3 runs its own
SHARED = GLM5Config.tiny(num_layers=4, indexer_types=("full", "shared", "shared", "full"))
TOL = dict(atol=2e-4, rtol=2e-4)


def tokens(n: int, seed: int, vocab: int = TINY.vocab_size) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def model_for(config: GLM5Config, seed: int = 0) -> GLM5ForCausalLM:
    return GLM5ForCausalLM(config, seed=seed)


# -- an independent plain-torch forward (HF glm_moe_dsa semantics) ---------------------------
def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta, interleaved):
    """x [S, H, R] rotated by position (docs/ops/common.md, apply_rope), written out pair by pair."""
    r = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = positions.double()[:, None] * inv_freq
    cos, sin = angle.cos()[:, None].float(), angle.sin()[:, None].float()
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : r // 2], x[..., r // 2:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.stack([ra, rb], -1).flatten(-2) if interleaved else torch.cat([ra, rb], -1)


def _rope_head(x, positions, c, interleaved):
    r = c.qk_rope_head_dim
    return torch.cat([_rope(x[..., :r], positions, c.rope_theta, interleaved), x[..., r:]], -1)


def _indexer_mask(ix, x, q_latent, positions, c):
    """[S, S] bool: the top index_topk earlier tokens each token's indexer keeps."""
    s = x.shape[0]
    q = _rope_head(ix.wq_b(q_latent).view(s, c.index_n_heads, c.index_head_dim), positions, c,
                   c.indexer_rope_interleaved)
    k = _rope_head(ix.k_norm(ix.wk(x))[:, None], positions, c, c.indexer_rope_interleaved)[:, 0]
    weights = ix.weights_proj(x) * c.index_n_heads ** -0.5
    scores = torch.einsum("shd,td->sht", q, k).mul(c.index_head_dim ** -0.5).relu()
    index = torch.einsum("sht,sh->st", scores, weights)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    top = index.masked_fill(~causal, float("-inf")).topk(min(c.index_topk, s), dim=-1).indices
    return torch.zeros(s, s, dtype=torch.bool).scatter(1, top, True) & causal


def _attention(attn, x, c, shared_mask=None):
    """The attention output, and the DSA mask it used (a "shared" layer gets its mask from
    the previous full layer)."""
    s, h = x.shape[0], c.num_heads
    positions = torch.arange(s)
    q_latent = _rms(attn.q_a_proj(x), attn.q_a_layernorm.weight, c.lora_norm_eps)
    q_nope, q_pe = attn.q_b_proj(q_latent).view(s, h, c.qk_head_dim).split(
        [c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    k_nope, v = attn.kv_b_proj(_rms(c_kv, attn.kv_a_layernorm.weight, c.lora_norm_eps)).view(
        s, h, c.qk_nope_head_dim + c.v_head_dim).split([c.qk_nope_head_dim, c.v_head_dim], -1)
    q = torch.cat([q_nope, _rope(q_pe, positions, c.rope_theta, c.rope_interleaved)], -1)
    k_pe = _rope(k_pe[:, None], positions, c.rope_theta, c.rope_interleaved).expand(s, h, -1)
    k = torch.cat([k_nope, k_pe], -1)
    scores = torch.einsum("shd,thd->hst", q, k) * c.qk_head_dim ** -0.5
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    mask = None
    if c.attention == "sparse":
        mask = shared_mask if attn.indexer is None else _indexer_mask(attn.indexer, x, q_latent, positions, c)
        allowed = allowed & mask
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return attn.o_proj(torch.einsum("hst,thv->shv", probs, v).reshape(s, h * c.v_head_dim)), mask


def _mlp(mlp, x):
    return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))


def _moe_loop(moe, x, c):
    """Routing (sigmoid, correction bias, group limit) and experts one token at a time."""
    inter = c.moe_intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = (moe.gate.weight.float() @ x[t].float()).sigmoid()
        choice = scores + moe.gate.e_score_correction_bias
        groups = choice.view(c.n_group, -1)
        group_score = groups.topk(min(2, groups.shape[1]), dim=-1).values.sum(-1)
        keep = torch.zeros(c.n_group, dtype=torch.bool)
        keep[group_score.topk(c.topk_group).indices] = True
        choice = choice.view(c.n_group, -1).masked_fill(~keep[:, None], float("-inf")).flatten()
        ids = choice.topk(c.num_experts_per_tok).indices
        weights = scores[ids]
        if c.norm_topk_prob:
            weights = weights / (weights.sum() + 1e-20)
        for e, w in zip(ids.tolist(), (weights * c.routed_scaling_factor).tolist()):
            gate_up = moe.experts.gate_up_proj[e]
            hidden = F.silu(gate_up[:inter] @ x[t]) * (gate_up[inter:] @ x[t])
            out[t] += w * (moe.experts.down_proj[e] @ hidden)
    if moe.shared_experts is not None:
        out = out + _mlp(moe.shared_experts, x)
    return out


@torch.no_grad()
def _plain_logits(model, ids):
    c = model.config
    x = model.model.embed_tokens(torch.tensor(ids))
    mask = None
    for i, layer in enumerate(model.model.layers):
        attended, mask = _attention(layer.self_attn, _rms(x, layer.input_layernorm.weight, c.rms_norm_eps), c, mask)
        x = x + attended
        h = _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        x = x + (_moe_loop(layer.mlp, h, c) if c.is_moe_layer(i) else _mlp(layer.mlp, h))
    return model.lm_head(_rms(x, model.model.norm.weight, c.rms_norm_eps))


# -- the model against the plain forward ------------------------------------------------------
@pytest.mark.parametrize("config", [TINY, DENSE, GROUPED, SHARED], ids=["dsa", "dense", "grouped-neox", "shared-topk"])
def test_model_equals_plain_unabsorbed_forward(config):
    model = model_for(config, seed=1)
    ids = tokens(20, seed=2)            # 20 > index_topk = 8: the indexer really selects
    expected = _plain_logits(model, ids)
    cache = model.new_cache(8, block_size=4)
    torch.testing.assert_close(model.prefill(cache, ["s"], [ids]), expected, **TOL)
    cache = model.new_cache(8, block_size=4)
    torch.testing.assert_close(model.prefill(cache, ["s"], [ids], mode="decode"), expected, **TOL)


def test_sparse_and_dense_differ_when_topk_is_below_context():
    """Guards the test above: with 20 tokens and top-8 the DSA selection changes logits."""
    ids = tokens(20, seed=2)
    sparse = model_for(TINY, seed=1).prefill(model_for(TINY).new_cache(8, 4), ["s"], [ids])
    dense_model = model_for(DENSE, seed=1)
    dense = dense_model.prefill(dense_model.new_cache(8, 4), ["s"], [ids])
    torch.testing.assert_close(sparse[:8], dense[:8], **TOL)       # context <= 8: all selected
    assert (sparse[8:] - dense[8:]).abs().max() > 1e-2


# -- paged KV plumbing ------------------------------------------------------------------------
@pytest.mark.parametrize("config", [TINY, FP8, FP8_UE8M0, DENSE, SHARED],
                         ids=["dsa", "fp8", "fp8-ue8m0", "dense", "shared-topk"])
def test_incremental_decode_equals_recompute_from_scratch(config):
    model = model_for(config, seed=3)
    seq = tokens(6, seed=4)
    cache = model.new_cache(16, block_size=4)
    model.prefill(cache, ["a"], [seq])
    model.prefill(cache, ["other"], [tokens(3, seed=5)])
    for i, t in enumerate(tokens(10, seed=6)):
        seq.append(t)
        got = model.decode(cache, ["a"], [t])[0]
        model.decode(cache, ["other"], [i])          # interleaves the two sequences' blocks
        fresh = model.new_cache(8, block_size=4)
        torch.testing.assert_close(got, model.prefill(fresh, ["a"], [seq])[-1], **TOL)
    table = cache.paged.block_table(["a"])[0].tolist()
    assert table != list(range(table[0], table[0] + len(table)))    # not contiguous in the pool


@pytest.mark.parametrize("config", [TINY, FP8, SHARED], ids=["dsa", "fp8", "shared-topk"])
def test_packed_prefill_equals_token_by_token(config):
    model = model_for(config, seed=7)
    prompts = [tokens(13, seed=8), tokens(5, seed=9), tokens(1, seed=10)]
    packed = model.prefill(model.new_cache(12, 4), ["a", "b", "c"], prompts)
    stepwise = model.prefill(model.new_cache(12, 4), ["a", "b", "c"], prompts, mode="decode")
    torch.testing.assert_close(packed, stepwise, **TOL)


def test_batched_decode_equals_each_sequence_alone():
    model = model_for(TINY, seed=11)
    prompts = {"a": tokens(5, seed=12), "b": tokens(11, seed=13)}
    feeds = {"a": tokens(6, seed=14), "b": tokens(6, seed=15)}
    together = model.new_cache(16, 4)
    model.prefill(together, ["a", "b"], [prompts["a"], prompts["b"]])
    batched = [model.decode(together, ["a", "b"], [feeds["a"][i], feeds["b"][i]]) for i in range(6)]
    for b, name in enumerate("ab"):
        alone = model.new_cache(8, 4)
        model.prefill(alone, [name], [prompts[name]])
        for i in range(6):
            torch.testing.assert_close(batched[i][b], model.decode(alone, [name], [feeds[name][i]])[0], **TOL)


def test_forked_prefix_continues_like_a_fresh_sequence():
    model = model_for(TINY, seed=16)
    prefix, rest = tokens(10, seed=17), tokens(7, seed=18)
    cache = model.new_cache(12, 4)
    model.prefill(cache, ["parent"], [prefix])
    shared = cache.fork("parent", "child")
    assert shared == 8                                # the two full blocks of 4
    child_logits = model.prefill(cache, ["child"], [prefix[shared:] + rest])
    assert cache.paged.block_table(["child"])[0, :2].tolist() == cache.paged.block_table(["parent"])[0, :2].tolist()
    fresh = model.prefill(model.new_cache(8, 4), ["x"], [prefix + rest])
    torch.testing.assert_close(child_logits, fresh[shared:], **TOL)
    cache.free("parent")
    cache.free("child")
    assert cache.paged.allocator.num_free == 12


# -- DSA with top-k covering the context is dense attention -----------------------------------
def test_dsa_with_topk_covering_context_equals_dense_decode():
    sparse = model_for(TINY.replace(index_topk=64), seed=19)
    dense = model_for(DENSE, seed=19)
    ids = tokens(16, seed=20)
    logits = []
    for model in (sparse, dense):
        cache = model.new_cache(8, 4)
        logits.append(model.prefill(cache, ["s"], [ids], mode="decode"))
    torch.testing.assert_close(logits[0], logits[1], **TOL)


# -- MoE --------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [TINY, GROUPED, TINY.replace(norm_topk_prob=False, n_shared_experts=0)],
                         ids=["glm5", "grouped", "unnormalised-no-shared"])
@torch.no_grad()
def test_moe_layer_equals_per_token_expert_loop(config):
    moe = model_for(config, seed=21).model.layers[1].mlp
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(22))
    torch.testing.assert_close(moe(x), _moe_loop(moe, x, config), **TOL)


# -- torch.compile ----------------------------------------------------------------------------
def _compiled_decode_matches_eager(backend: str):
    torch._dynamo.reset()
    model = model_for(TINY.replace(num_layers=2), seed=23)   # a dense and a MoE layer
    cache = model.new_cache(16, 4)
    model.prefill(cache, ["a", "b"], [tokens(10, seed=24), tokens(3, seed=25)])
    step = cache.step(["a", "b"], [1, 1], packed=False)
    copies = [LayerCache(c.kv.clone(), c.index_keys.clone()) for c in cache.layers]
    ids = torch.tensor([7, 9])
    with torch.no_grad():
        eager = model.decode_step(ids, *step[:4], cache.layers)
        compiled = torch.compile(model.decode_step, fullgraph=True, backend=backend)(ids, *step[:4], copies)
    torch.testing.assert_close(compiled, eager, **TOL)
    for mine, theirs in zip(copies, cache.layers):   # the in-place cache writes happened too
        torch.testing.assert_close(mine.kv, theirs.kv, **TOL)
        torch.testing.assert_close(mine.index_keys, theirs.index_keys, **TOL)


def test_compile_fullgraph_decode_step_matches_eager():
    _compiled_decode_matches_eager("aot_eager")


@pytest.mark.slow
def test_compile_fullgraph_decode_step_with_inductor_matches_eager():
    _compiled_decode_matches_eager("inductor")


# -- HF state-dict names ----------------------------------------------------------------------
def _hf_names_and_shapes(c: GLM5Config) -> dict[str, list[int]]:
    """The parameter names and shapes of an HF glm_moe_dsa checkpoint of config c."""
    names = {"model.embed_tokens.weight": [c.vocab_size, c.hidden_size],
             "model.norm.weight": [c.hidden_size], "lm_head.weight": [c.vocab_size, c.hidden_size]}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        names.update({
            p + "input_layernorm.weight": [c.hidden_size],
            p + "post_attention_layernorm.weight": [c.hidden_size],
            p + "self_attn.q_a_proj.weight": [c.q_lora_rank, c.hidden_size],
            p + "self_attn.q_a_layernorm.weight": [c.q_lora_rank],
            p + "self_attn.q_b_proj.weight": [c.num_heads * c.qk_head_dim, c.q_lora_rank],
            p + "self_attn.kv_a_proj_with_mqa.weight": [c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size],
            p + "self_attn.kv_a_layernorm.weight": [c.kv_lora_rank],
            p + "self_attn.kv_b_proj.weight": [c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank],
            p + "self_attn.o_proj.weight": [c.hidden_size, c.num_heads * c.v_head_dim],
        })
        if not c.shares_topk(i):          # a "shared" layer has no indexer, in HF as here
            names.update({
                p + "self_attn.indexer.wq_b.weight": [c.index_n_heads * c.index_head_dim, c.q_lora_rank],
                p + "self_attn.indexer.wk.weight": [c.index_head_dim, c.hidden_size],
                p + "self_attn.indexer.k_norm.weight": [c.index_head_dim],
                p + "self_attn.indexer.k_norm.bias": [c.index_head_dim],
                p + "self_attn.indexer.weights_proj.weight": [c.index_n_heads, c.hidden_size],
            })
        mlps = []
        if c.is_moe_layer(i):
            names[p + "mlp.gate.weight"] = [c.n_routed_experts, c.hidden_size]
            names[p + "mlp.gate.e_score_correction_bias"] = [c.n_routed_experts]
            mlps = [(f"mlp.experts.{e}.", c.moe_intermediate_size) for e in range(c.n_routed_experts)]
            mlps.append(("mlp.shared_experts.", c.moe_intermediate_size * c.n_shared_experts))
        else:
            mlps = [("mlp.", c.intermediate_size)]
        for prefix, inter in mlps:
            names[p + prefix + "gate_proj.weight"] = [inter, c.hidden_size]
            names[p + prefix + "up_proj.weight"] = [inter, c.hidden_size]
            names[p + prefix + "down_proj.weight"] = [c.hidden_size, inter]
    return names


def test_state_dict_has_hf_checkpoint_names_and_round_trips():
    assert {k: list(v.shape) for k, v in model_for(SHARED).state_dict().items()} == _hf_names_and_shapes(SHARED)
    model = model_for(TINY, seed=26)
    state = model.state_dict()
    assert {k: list(v.shape) for k, v in state.items()} == _hf_names_and_shapes(TINY)
    loaded = GLM5ForCausalLM(TINY)                    # uninitialised
    loaded.load_state_dict(state)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name]), name
    ids = tokens(9, seed=27)
    torch.testing.assert_close(loaded.prefill(loaded.new_cache(4), ["s"], [ids]),
                               model.prefill(model.new_cache(4), ["s"], [ids]), atol=0, rtol=0)


def test_load_state_dict_accepts_the_fused_expert_layout():
    model = model_for(TINY, seed=28)
    fused = dict(model.named_parameters())          # gate_up_proj / down_proj stacked per layer
    fused.update(model.named_buffers())
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    loaded = GLM5ForCausalLM(TINY)
    loaded.load_state_dict(fused)
    assert torch.equal(loaded.model.layers[2].mlp.experts.down_proj, model.model.layers[2].mlp.experts.down_proj)


def test_load_state_dict_reports_an_incomplete_expert_set():
    state = model_for(TINY, seed=29).state_dict()
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        GLM5ForCausalLM(TINY).load_state_dict(state)


def test_state_dict_per_expert_tensors_do_not_share_storage():
    state = model_for(TINY, seed=30).state_dict()
    pointers = [t.untyped_storage().data_ptr() for t in state.values()]
    assert len(set(pointers)) == len(pointers)


# -- backends ---------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [TINY, FP8], ids=["dsa", "fp8"])
def test_reference_backend_and_default_dispatch_agree(config):
    model = model_for(config, seed=31)
    prompts, feeds = [tokens(9, seed=32), tokens(4, seed=33)], tokens(4, seed=34)

    def run():
        cache = model.new_cache(12, 4)
        out = [model.prefill(cache, ["a", "b"], prompts)]
        out += [model.decode(cache, ["a", "b"], [t, t]) for t in feeds]
        return torch.cat(out)

    with hal.use("reference"):
        reference = run()
    torch.testing.assert_close(run(), reference, atol=1e-3, rtol=1e-3)


def test_bfloat16_model_tracks_float32():
    ids = tokens(12, seed=35)
    full = model_for(TINY, seed=36)
    half = GLM5ForCausalLM(TINY, seed=36, dtype=torch.bfloat16)
    assert half.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    gate = half.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == gate.weight.dtype == torch.float32    # kept exact, as HF keeps them
    assert torch.equal(gate.e_score_correction_bias, full.model.layers[1].mlp.gate.e_score_correction_bias)
    assert torch.equal(gate.weight, full.model.layers[1].mlp.gate.weight)
    a = full.prefill(full.new_cache(4), ["s"], [ids])
    b = half.prefill(half.new_cache(4), ["s"], [ids])
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.95


# -- generation -------------------------------------------------------------------------------
def test_generate_is_greedy_and_frees_its_sequences():
    model = model_for(TINY, seed=37)
    prompt = tokens(7, seed=38)
    cache = model.new_cache(16, 4)
    out = model.generate(prompt, 5, cache=cache)
    assert len(out) == 5 and cache.paged.allocator.num_free == 16
    seq = list(prompt)
    for t in out:                                     # each token is the argmax given the ones before
        assert t == int(_plain_logits(model, seq)[-1].argmax())
        seq.append(t)
    assert model.generate(prompt, 5, prefill="decode") == out
    batch = model.generate([prompt, tokens(3, seed=39)], 5)
    assert batch[0] == out and batch[1] == model.generate(tokens(3, seed=39), 5)
    assert model.generate(prompt, 0) == []


def test_invalid_inputs_name_the_argument():
    model = model_for(TINY, seed=40)
    with pytest.raises(hal.InvalidInputError, match="prompt_ids.*512"):
        model.generate([1, 512], 2)
    with pytest.raises(hal.InvalidInputError, match="max_new_tokens"):
        model.generate([1], -1)
    cache = model.new_cache(2, 4)
    with pytest.raises(hal.InvalidInputError, match="seq_ids"):
        model.decode(cache, ["missing"], [1])
    with pytest.raises(hal.InvalidInputError, match="mode"):
        model.prefill(cache, ["s"], [[1]], mode="chunked")
    with pytest.raises(hal.InvalidInputError, match="at least one token"):
        model.prefill(cache, ["s"], [[]])
    with pytest.raises(OutOfBlocksError):
        model.prefill(cache, ["s"], [tokens(9, seed=41)])
    assert "s" not in cache and cache.paged.allocator.num_free == 2     # nothing reserved
    with pytest.raises(hal.InvalidInputError, match="GLM5Config.*index_head_dim.*power of two"):
        GLM5Config.tiny(index_head_dim=24)
    with pytest.raises(hal.InvalidInputError, match="GLM5Config.*attention"):
        GLM5Config.tiny(attention="linear")
    with pytest.raises(hal.InvalidInputError, match="GLM5Config.*indexer_types.*3 of"):
        GLM5Config.tiny(indexer_types=["full", "shared"])
    with pytest.raises(hal.InvalidInputError, match="GLM5Config.*indexer_types.*'full' for layer 0"):
        GLM5Config.tiny(indexer_types=["shared", "full", "full"])


def test_shared_layers_have_no_indexer_and_no_indexer_cache():
    model = model_for(SHARED)
    assert SHARED.indexer_types == ("full", "shared", "shared", "full")       # a list becomes a tuple
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, True, False]
    cache = model.new_cache(4, 4)
    assert [c.index_keys is None for c in cache.layers] == [False, True, True, False]
    with record_ops() as calls:
        model.prefill(cache, ["s"], [tokens(12, seed=90)])
        model.decode(cache, ["s"], [3])
    # one indexer per full layer; every layer attends sparsely
    assert calls.counts["indexer_topk"] == 2 and calls.counts["indexer_topk_paged"] == 2
    assert calls.counts["sparse_mla_attention"] == 4 and calls.counts["sparse_mla_decode_paged"] == 4


def test_glm5_config_has_the_real_dimensions():
    c = GLM5Config.glm5()
    assert (c.hidden_size, c.num_layers, c.num_heads, c.d_qk, c.d_v) == (6144, 78, 64, 576, 512)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.n_routed_experts) == (32, 128, 2048, 256)
    assert c.sm_scale == 256 ** -0.5
    assert isinstance(GLM5Cache(GLM5Config.glm5(num_layers=1, first_dense_layers=1), 1, 64).layers[0].kv, torch.Tensor)


def test_record_ops_sees_every_op_of_a_decode_step():
    model = model_for(FP8, seed=42)
    cache = model.new_cache(4)
    model.prefill(cache, ["s"], [tokens(5, seed=43)])
    with record_ops() as calls:
        model.decode(cache, ["s"], [3])
    assert set(calls.counts) == {
        "rms_norm", "apply_rope", "kv_cache_write", "hadamard_transform", "fp8_block_quant",
        "indexer_k_cache_write", "indexer_topk_paged", "sparse_mla_decode_paged", "silu_and_mul",
        "moe_route", "moe_permute", "grouped_gemm", "moe_unpermute"}
    assert calls.counts["sparse_mla_decode_paged"] == FP8.num_layers
    assert calls.counts["moe_route"] == FP8.num_layers - FP8.first_dense_layers


# -- the demo command -------------------------------------------------------------------------
def test_demo_command_prints_tokens_speed_and_dispatch(capsys):
    assert cli.main(["demo", "--tokens", "3", "--prompt-len", "5", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    generated = next(line for line in out.splitlines() if line.startswith("generated"))
    assert len(generated.split(":")[1].split()) == 3
    assert "tokens/s" in out
    for op in ("sparse_mla_decode_paged", "indexer_topk_paged", "moe_route", "grouped_gemm", "rms_norm"):
        assert op in out
    assert "fallbacks to the reference while the demo ran" in out


def test_demo_pinned_to_the_reference_reports_no_fallbacks():
    from glm5_hal.models import demo
    out = io.StringIO()
    result = demo.run(tokens=2, backend="reference", seed=2, prompt_len=4, fp8_indexer=True, out=out)
    assert len(result["tokens"]) == 2
    assert set(result["implementations"].values()) == {f"reference.{op}" for op in result["implementations"]}
    assert "fp8_block_quant" in result["implementations"] and result["fallbacks"] == {}
    assert "fallbacks to the reference while the demo ran: none" in out.getvalue()
    unpinned = demo.run(tokens=2, seed=2, prompt_len=4, fp8_indexer=True, out=io.StringIO())
    assert unpinned["tokens"] == result["tokens"]


def test_demo_with_an_unknown_backend_fails_cleanly(capsys):
    assert cli.main(["demo", "--tokens", "2", "--backend", "no-such-backend"]) == 2
    assert "no-such-backend" in capsys.readouterr().err


def test_demo_with_an_unusable_device_fails_cleanly(capsys):
    assert cli.main(["demo", "--tokens", "2", "--device", "no-such-device"]) == 2
    assert "no-such-device" in capsys.readouterr().err
