"""glm5_hal.integrations.transformers: HF transformers' own GlmMoeDsaForCausalLM on glm5_hal ops
gives HF eager's logits (fp32, 1e-4 relative) and greedy generate() tokens, with and without
cross-layer top-k sharing, on default dispatch, the reference and an emulated vendor backend.

transformers is a pinned test dependency (requirements/cpu.txt); without it these tests skip.
The weights come from glm5_hal.models' seeded initialisation (unit-scale activations, so
attention, DSA selection and routing are far from uniform) and are loaded into every model:
HF eager, HF + glm5_hal, and GLM5ForCausalLM itself.
"""
from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.models import GLM5Config, GLM5ForCausalLM

from conftest import run_python

transformers = pytest.importorskip("transformers")
from glm5_hal.integrations import transformers as hal_transformers  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::glm5_hal.FallbackWarning"),
              pytest.mark.usefixtures("one_thread")]

TINY_HF = dict(
    vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=64,
    q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, num_experts_per_tok=2,
    index_topk=8, index_head_dim=32, index_n_heads=16, first_k_dense_replace=1,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, pad_token_id=0)
FULL = ["full"] * 4
SHARED = ["full", "shared", "shared", "full"]       # layers 1, 2 reuse layer 0's top-k
PROMPT = 20                                          # > index_topk = 8: the indexer really selects




def hf_config(indexer_types=SHARED, **overrides):
    return transformers.GlmMoeDsaConfig(**{**TINY_HF, **overrides}, indexer_types=indexer_types)


def build(config, attn: str, experts: str | None = None, seed: int = 1):
    """An HF model of `config` with glm5_hal.models' seeded weights (its own config copy:
    from_config writes the implementation into the config it is given)."""
    hal_transformers.register()
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=attn, experts_implementation=experts or attn,
        dtype=torch.float32).eval()
    # the weights do not depend on the rope (GLM5Config takes no rope scaling)
    ours = GLM5ForCausalLM(GLM5Config.from_hf_config({**config.to_dict(), "rope_parameters": None}), seed=seed)
    model.load_state_dict({**dict(ours.named_parameters()), **dict(ours.named_buffers())}, strict=True)
    return model


def ids(batch: int = 1, length: int = PROMPT, seed: int = 2) -> torch.Tensor:
    return torch.randint(1, TINY_HF["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-4 of the logits' scale (max |expected|), element by element."""
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-4 * scale, float((got - expected).abs().max() / scale)


def logits(model, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, attention_mask=mask).logits


def generate(model, tokens: torch.Tensor, mask: torch.Tensor | None = None, new: int = 8, **kwargs) -> list:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")              # HF's generation-config notices
        out = model.generate(tokens, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)
    return out[:, tokens.shape[1]:].tolist()


# -- the same logits and tokens as HF eager ---------------------------------------------------------
@pytest.mark.parametrize("types", [FULL, SHARED], ids=["full", "shared-topk"])
def test_logits_and_greedy_tokens_equal_hf_eager(types):
    config = hf_config(types)
    eager, routed = build(config, "eager"), build(config, "glm5_hal")
    prompt = ids()
    assert_logits_close(logits(routed, prompt), logits(eager, prompt))
    assert generate(routed, prompt) == generate(eager, prompt)


def test_left_padded_batch_equals_hf_eager():
    """Padding reaches the DSA ops as per-query key ranges (key_ranges_mask of HF's mask)."""
    config = hf_config()
    eager, routed = build(config, "eager"), build(config, "glm5_hal")
    prompt = ids(batch=2)
    mask = torch.ones_like(prompt)
    mask[1, :7] = 0                                    # the second prompt is 13 tokens, left padded
    valid = mask.bool()
    assert_logits_close(logits(routed, prompt, mask)[valid], logits(eager, prompt, mask)[valid])
    assert generate(routed, prompt, mask) == generate(eager, prompt, mask)


def test_glm5_hal_models_agrees_with_hf_on_shared_topk():
    """glm5_hal.models' own cross-layer top-k sharing against HF's, same weights."""
    config = hf_config()
    ours = GLM5ForCausalLM(GLM5Config.from_hf_config(config), seed=1)
    eager = build(config, "eager")
    prompt = ids()
    assert_logits_close(ours.prefill(ours.new_cache(8, 4), ["s"], prompt.tolist()), logits(eager, prompt)[0])
    assert ours.generate(prompt[0].tolist(), 8) == generate(eager, prompt)[0]


def test_static_cache_and_a_cache_started_by_hf_eager():
    config = hf_config()
    eager, routed = build(config, "eager"), build(config, "glm5_hal")
    prompt = ids()
    expected = generate(eager, prompt)
    assert generate(routed, prompt, cache_implementation="static") == expected
    # HF's cache layout is kept: a prefill by HF eager continues on glm5_hal (the cache is the
    # 4th positional argument: `past_key_values` in transformers 5.23, `cache` in 5.24)
    cache = transformers.DynamicCache(config=eager.config)
    with torch.no_grad():
        first = eager(prompt, None, None, cache, use_cache=True).logits[:, -1:].argmax(-1)
        eager.set_attn_implementation("glm5_hal")
        eager.set_experts_implementation("glm5_hal")
        with hal_transformers.record_ops() as calls:
            step = eager(first, None, None, cache, use_cache=True)
    assert calls.counts["sparse_mla_attention"] == 4
    assert [first.item(), step.logits[0, -1].argmax().item()] == expected[0][:2]


# -- backends -----------------------------------------------------------------------------------------
def test_reference_backend_gives_the_same_logits_and_tokens():
    config = hf_config()
    eager, routed = build(config, "eager"), build(config, "glm5_hal")
    prompt = ids()
    with hal.use("reference"):
        got_logits, got_tokens = logits(routed, prompt), generate(routed, prompt)
    assert_logits_close(got_logits, logits(eager, prompt))
    assert got_tokens == generate(eager, prompt)


@pytest.mark.slow
def test_emulated_vendor_backend_serves_the_model_and_fallbacks_are_counted(hal_state, monkeypatch):
    """On an emulated Cambricon MLU590 (tests/emulators/cambricon.py, cpu backend disabled as
    on an MLU host): the ops the vendor serves are those called minus those counted in
    hal.fallback_stats(), and the vendor's own functions ran."""
    from test_cambricon import EMU, as_plugin, emulated
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = emulated("MLU590")
    hal_state(as_plugin(backend), EMU)
    config = hf_config()
    eager, routed = build(config, "eager"), build(config, "glm5_hal")
    prompt = ids()
    with hal.use(EMU), hal_transformers.record_ops() as calls:
        got_logits, got_tokens = logits(routed, prompt), generate(routed, prompt)
    assert_logits_close(got_logits, logits(eager, prompt))
    assert got_tokens == generate(eager, prompt)
    fallbacks = {op for (op, name, _), n in hal.fallback_stats().items() if name == EMU and n}
    served = set(calls.counts) - fallbacks
    assert {"rms_norm", "apply_rope", "moe_permute", "grouped_gemm", "silu_and_mul", "moe_unpermute"} <= served
    assert all(hal.explain(op, *calls.first_args[op]).chosen == f"{EMU}.{op}" for op in served)
    for op in fallbacks:                        # each fallback is a decline with its reason
        assert dict(hal.explain(op, *calls.first_args[op]).rejected)[f"{EMU}.{op}"]
    assert backend.runtime.tmo.calls["group_gemm"] > 0 and backend.runtime.tmo.calls["fused_rms_norm"] > 0


def test_default_dispatch_serves_every_routed_op_natively():
    """On this machine's default dispatch (the cpu backend) nothing falls back."""
    hal.reload()
    routed = build(hf_config(), "glm5_hal")
    with hal_transformers.record_ops() as calls:
        generate(routed, ids(), new=2)
    assert set(calls.counts) == {"rms_norm", "apply_rope", "indexer_topk", "sparse_mla_attention", "moe_permute",
                                 "grouped_gemm", "silu_and_mul", "moe_unpermute"}
    assert calls.counts["indexer_topk"] == 2 * 2          # 2 full layers x (prefill + 1 decode step)
    assert not [k for k in hal.fallback_stats() if k[0] in calls.counts]


# -- apply(), register(), versions ---------------------------------------------------------------------
def test_apply_switches_a_built_model_and_restore_undoes_it():
    config = hf_config()
    model, eager = build(config, "eager"), build(config, "eager")
    applied = hal_transformers.apply(model)
    assert (applied.attn_implementation, applied.experts_implementation) == ("eager", "eager")
    assert applied.attention == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert applied.experts == [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    assert "model.norm" in applied.norms and "model.layers.0.self_attn.kv_a_layernorm" in applied.norms
    prompt = ids()
    with hal_transformers.record_ops() as calls:
        assert_logits_close(logits(model, prompt), logits(eager, prompt))
    assert calls.counts["sparse_mla_attention"] == 4 and calls.counts["grouped_gemm"] == 6
    assert calls.counts["rms_norm"] == 4 * 2 + 1 + 4 * 2           # layer norms, final norm, q_a / kv_a
    applied.restore()
    with hal_transformers.record_ops() as calls:
        logits(model, prompt)
    assert not calls.counts and model.config._attn_implementation == "eager"


def test_norms_follow_set_attn_implementation_on_a_model_built_before_register():
    model = build(hf_config(), "eager")
    for module in model.modules():                 # as if built before register()
        module.__dict__.pop("_glm5_hal_config", None)
        module.__dict__.pop("_glm5_hal_norms_linked", None)
    model.set_attn_implementation("glm5_hal")
    with hal_transformers.record_ops() as calls:
        logits(model, ids())
    assert calls.counts["rms_norm"] == 4 * 2 + 1 + 4 * 2


def test_apply_leaves_a_model_it_does_not_recognise_unchanged():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    before = llama.config._attn_implementation
    for model in (llama, GLM5ForCausalLM(GLM5Config.tiny(), seed=0), torch.nn.Linear(2, 2)):
        with pytest.raises(hal.InvalidInputError, match="apply.*model.*glm_moe_dsa"):
            hal_transformers.apply(model)
    assert llama.config._attn_implementation == before


def test_another_model_asking_for_glm5_hal_attention_gets_a_clear_error():
    hal_transformers.register()
    llama = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        attn_implementation="glm5_hal")
    with pytest.raises(hal.InvalidInputError, match="module.*GlmMoeDsaAttention.*LlamaAttention"):
        llama(torch.tensor([[1, 2, 3]]))


def test_register_is_idempotent_and_eager_models_stay_hf():
    hal_transformers.register()
    hal_transformers.register()
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm
    forward = glm.GlmMoeDsaAttention.forward
    assert not hasattr(forward._glm5_hal_original, "_glm5_hal_original")    # wrapped once
    eager = build(hf_config(), "eager")
    with hal_transformers.record_ops() as calls:
        logits(eager, ids())
    assert not calls.counts


def test_an_untested_transformers_version_warns_once(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    monkeypatch.setattr(hal_transformers, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hal_transformers.register()
        hal_transformers.register()
    untested = [w for w in caught if issubclass(w.category, hal_transformers.UntestedVersionWarning)]
    assert len(untested) == 1 and "99.0.0" in str(untested[0].message)
    assert transformers.__version__ not in hal_transformers.TESTED_VERSIONS


@pytest.mark.slow
def test_importing_glm5_hal_never_imports_transformers():
    result = run_python("""
        import sys
        import glm5_hal, glm5_hal.ops, glm5_hal.models, glm5_hal.integrations, glm5_hal.bench.hf_decode
        glm5_hal.models.GLM5Config.from_hf_config({})
        assert "transformers" not in sys.modules, "transformers was imported"
    """)
    assert result.returncode == 0, result.stderr


def test_the_decode_benchmark_runs_from_the_cli(monkeypatch, capsys):
    """`glm5-hal bench --hf-decode` (docs/performance.md) on a short tiny case: every
    implementation timed, the same greedy tokens from all of them."""
    from glm5_hal import cli
    from glm5_hal.bench import hf_decode
    monkeypatch.setattr(hf_decode, "CASES", (("tiny", 1, 12, 3),))
    assert cli.main(["bench", "--hf-decode", "--preset", "tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "HF eager" in out and "HF + glm5_hal" in out and "glm5_hal.models" in out
    row = out.strip().splitlines()[-1].split()
    assert row[:4] == ["tiny", "1", "12", "1"] and row[-1] == "yes"       # the tokens agree
    assert all(float(rate) > 0 for rate in row[4:8])


# -- parts ---------------------------------------------------------------------------------------------
def test_key_ranges_of_hf_masks():
    from glm5_hal.integrations.transformers.attention import key_ranges
    allowed = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)[None, None].expand(1, 1, 3, 4)
    start, end = key_ranges(allowed)
    assert start.tolist() == [[0, 1, 0]] and end.tolist() == [[3, 3, 0]]
    additive = torch.zeros(1, 1, 3, 4).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert [t.tolist() for t in key_ranges(additive)] == [start.tolist(), end.tolist()]
    holes = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)[None, None]
    with pytest.raises(hal.InvalidInputError, match="attention_mask.*contiguous"):
        key_ranges(holes)
    with pytest.raises(hal.InvalidInputError, match="attention_mask.*additive"):
        key_ranges(torch.full((1, 1, 1, 4), -2.0))


def test_rope_scaling_goes_through_hfs_cos_and_sin():
    """A rope type other than "default" keeps HF's frequencies (apply_rope takes a base only)."""
    config = hf_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})
    eager, routed = build(config, "eager"), build(config, "glm5_hal")
    prompt = ids(batch=2)
    with hal_transformers.record_ops() as calls:
        got = logits(routed, prompt)
    assert "apply_rope" not in calls.counts
    assert_logits_close(got, logits(eager, prompt))


class _Fp8GroupedGemmStandIn:
    """glm5_hal.ops plus docs/ops/quant.md's fp8_grouped_gemm written in torch, for a glm5_hal whose ops
    do not define it yet (it is specified, not yet merged): checks this integration's wiring
    (argument order, scale layout) against the contract."""

    def __getattr__(self, name):
        return getattr(hal.ops, name)

    @staticmethod
    def fp8_grouped_gemm(a, a_scale, w, w_scale, tokens_per_expert, out_dtype):
        def deq(x, s, rows, cols):
            return x.float() * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        counts = tokens_per_expert.tolist()
        return torch.cat([(rows.float() * s.repeat_interleave(128, 1)[:, :rows.shape[1]]) @ deq(w[e], w_scale[e],
                          *w.shape[1:]).T for e, (rows, s) in enumerate(zip(a.split(counts), a_scale.split(counts)))
                          ]).to(out_dtype)


def fp8_experts():
    """transformers' FP8Experts (128 x 128 block scales that multiply) with random FP8 weights,
    its dequantized weights, and inputs."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation
    hal_transformers.register()
    config = hf_config(hidden_size=256, moe_intermediate_size=128, n_routed_experts=4)
    config._experts_implementation = "glm5_hal"
    module = use_experts_implementation(FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)(
        config, block_size=[128, 128])
    g = torch.Generator().manual_seed(3)
    dense = {}
    for name, (n, k) in {"gate_up_proj": (256, 256), "down_proj": (256, 128)}.items():
        blocks = (torch.randn(4, n, k, generator=g) / k ** 0.5).view(4, n // 128, 128, k // 128, 128)
        scale = blocks.abs().amax((2, 4)) / 448
        fp8 = (blocks / scale[:, :, None, :, None]).view(4, n, k).to(torch.float8_e4m3fn)
        getattr(module, name).data, getattr(module, name + "_scale_inv").data = fp8, scale
        dense[name] = (fp8.float().view(4, n // 128, 128, k // 128, 128) * scale[:, :, None, :, None]).view(4, n, k)
    inputs = (torch.randn(6, 256, generator=g), torch.tensor([[0, 2], [1, 3], [2, 0], [3, 3], [0, 1], [2, 3]]),
              torch.rand(6, 2, generator=g))
    return module, dense, inputs


def test_fp8_experts_run_fp8_grouped_gemm(monkeypatch):
    """FP8Experts through fp8_block_quant + fp8_grouped_gemm equal the same quantization in plain
    torch: activations per token and 128 columns, weights dequantized. (HF's own FP8 experts
    need its Triton or DeepGEMM kernels, which this CPU-only machine cannot run.)"""
    from glm5_hal.integrations.transformers import experts
    if not hasattr(hal.ops, "fp8_grouped_gemm"):
        monkeypatch.setattr(experts, "ops", _Fp8GroupedGemmStandIn())
    module, dense, (x, ids_, weights) = fp8_experts()

    def quant(a):
        s = a.view(a.shape[0], -1, 128).abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
        return ((a.view(a.shape[0], -1, 128) / s).to(torch.float8_e4m3fn).float() * s).view(a.shape)

    expected = torch.zeros(6, 256)
    for t in range(6):
        for j in range(2):
            e = int(ids_[t, j])
            gate, up = (quant(x[t:t + 1]) @ dense["gate_up_proj"][e].T).chunk(2, -1)
            expected[t] += weights[t, j] * (quant(torch.nn.functional.silu(gate) * up) @ dense["down_proj"][e].T)[0]
    with hal_transformers.record_ops() as calls:
        got = module(x, ids_, weights)
    assert calls.counts["fp8_grouped_gemm"] == 2 and calls.counts["fp8_block_quant"] == 2
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_an_fp8_kv_b_proj_is_dequantized_for_absorption():
    """GLM-5's FP8 checkpoint has an FP8 kv_b_proj (transformers' FP8Linear); absorption needs
    W_UK and W_UV as matrices: the attention equals one whose kv_b_proj holds the dequantized
    weight. (The model's other FP8 linears run HF's Triton/DeepGEMM kernels: not on this CPU.)"""
    from transformers.integrations.finegrained_fp8 import FP8Linear
    config = hf_config()
    model = build(config, "glm5_hal")
    attn = model.model.layers[0].self_attn
    weight = attn.kv_b_proj.weight.detach()                        # [256, 64]: 2 x 1 blocks of 128
    scale = weight.view(2, 128, 64).abs().amax((1, 2)).view(2, 1) / 448
    fp8 = FP8Linear(64, 256, block_size=[128, 128])
    fp8.weight.data = (weight.view(2, 128, 64) / scale.view(2, 1, 1)).view(256, 64).to(torch.float8_e4m3fn)
    fp8.weight_scale_inv.data = scale
    dequantized = (fp8.weight.float().view(2, 128, 64) * scale.view(2, 1, 1)).view(256, 64)
    prompt = ids()
    attn.kv_b_proj = fp8
    got = logits(model, prompt)
    attn.kv_b_proj = torch.nn.Linear(64, 256, bias=False)
    attn.kv_b_proj.weight.data = dequantized
    torch.testing.assert_close(got, logits(model, prompt), atol=1e-5, rtol=1e-5)
