"""GLM5ForCausalLM.from_pretrained / save_pretrained: HF-layout checkpoint directories, BF16 and
FP8 (DeepSeek-V3 / GLM-5-FP8 block format), sharded, INT8 conversion at load, the errors, the
MTP layer, and `glm5-hal demo --checkpoint`.

The FP8 checkpoints are written here from a BF16 model's weights, quantized per 128 x 128 block
in plain torch (independently of glm5_hal), as DeepSeek-V3's FP8 conversion does: scale =
block amax / 448, weight / scale rounded to e4m3, the scale stored as `weight_scale_inv`.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import glm5_hal as hal
from glm5_hal import cli
from glm5_hal.models import CheckpointError, GLM5Config, GLM5ForCausalLM, SkippedTensorsWarning, record_ops
from glm5_hal.models.layers import expert_views
from glm5_hal.models.quantized import Fp8Experts, Fp8Linear, Int8Experts, Int8Linear

pytestmark = [pytest.mark.filterwarnings("ignore::glm5_hal.FallbackWarning"),
              pytest.mark.usefixtures("one_thread")]

FP8 = torch.float8_e4m3fn
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
#: The float tests' model: GLM-5's structure with top-k sharing (layer 1 has no indexer).
TINY = GLM5Config.tiny(indexer_types=("full", "shared", "full"))
#: The FP8 model: every GEMM input a multiple of 128 (q_lora_rank, moe_intermediate_size, the o_proj
#: input 4 x 32); outputs with partial 128-row blocks (q_b_proj 192, kv_a_proj 80, wk 32). The
#: absorbed kv_b_proj has a 64-column input (one partial block). index_topk covers the context and
#: every expert is active, so that the logits are continuous in the activations (see the FP8 test).
FP8_TINY = GLM5Config.tiny(q_lora_rank=128, moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=4,
                           index_topk=64)
PROMPT = 20




def tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logits(model: GLM5ForCausalLM, ids: list[int]) -> torch.Tensor:
    return model.prefill(model.new_cache(-(-len(ids) // 4), 4), ["s"], [ids])


def relative_rms(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


def fp8_blocks(w: torch.Tensor, spread: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale [ceil(N/128), ceil(K/128)], the dequantized float32 weight).
    With `spread`, each block's scale is multiplied by 2^u, u random in [0, SCALE_SPREAD]."""
    n, k = w.shape
    n2, k2 = -(-n // 128) * 128, -(-k // 128) * 128
    blocks = F.pad(w.float(), (0, k2 - k, 0, n2 - n)).view(n2 // 128, 128, k2 // 128, 128)
    scale = blocks.abs().amax((1, 3)) / 448
    if spread is not None:
        scale = scale * torch.exp2(torch.randint(0, SCALE_SPREAD + 1, scale.shape, generator=spread).float())
    q = (blocks / scale[:, None, :, None]).view(n2, k2)[:n, :k].to(FP8)
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return q, scale, q.float() * full


def is_fp8_linear(name: str, t: torch.Tensor) -> bool:
    """The linear weights an FP8 GLM-5 checkpoint stores in FP8 (as transformers' FP8 quantizer
    converts them): every decoder linear layer but the indexer's head weights; never the router,
    the norms, the embeddings or lm_head."""
    return (name.endswith(".weight") and ".layers." in name and t.ndim == 2 and "mlp.gate.weight" not in name
            and "weights_proj" not in name)


def write_checkpoint(root: Path, config: GLM5Config, tensors: dict, quantization_config=None, **fields) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    hf = {**config.to_hf_config(), "dtype": "bfloat16", **fields}
    if quantization_config is not None:
        hf["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"),
              metadata={"format": "pt"})
    return root


#: How far the FP8 test checkpoints' block scales spread: each 128 x 128 block's scale is its
#: amax / 448 times 2^u, u a random integer in [0, SCALE_SPREAD] (codes of at most 448 / 2^u),
#: so that the scales of one weight differ by up to 2^10 ~ 10^3 while the dequantized weights
#: keep their magnitudes (the model stays the same function, only some blocks coarser). A scale
#: applied to the wrong block (a transposed or shifted grid) then changes weights by orders of
#: magnitude, not by the few percent that separate the block maxima of Gaussian weights.
SCALE_SPREAD = 10


def fp8_checkpoint(root: Path, config: GLM5Config = FP8_TINY, seed: int = 1):
    """An FP8 checkpoint quantized from a BF16 model's weights (block scales spread over
    SCALE_SPREAD powers of two), and the state dict of the dequantized model (float32)."""
    state = GLM5ForCausalLM(config, seed=seed, dtype=torch.bfloat16).state_dict()
    g = torch.Generator().manual_seed(seed + 100)
    tensors, dequantized = {}, {}
    for name, t in state.items():
        if is_fp8_linear(name, t):
            q, scale, dense = fp8_blocks(t, g)
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, scale
            dequantized[name] = dense
        else:
            tensors[name], dequantized[name] = t, t.float()
    return write_checkpoint(root, config, tensors, FP8_CONFIG), dequantized


def bf16_checkpoint(root: Path, config: GLM5Config = TINY, seed: int = 1, **fields) -> Path:
    state = GLM5ForCausalLM(config, seed=seed, dtype=torch.bfloat16).state_dict()
    return write_checkpoint(root, config, state, **fields)


def file_tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


# -- FP8 --------------------------------------------------------------------------------------------
def test_fp8_checkpoint_matches_the_dequantized_model(tmp_path):
    """The FP8 model's logits against a float32 model holding the dequantized weights.

    The weights are then the same numbers; the only difference is that the FP8 model rounds
    every GEMM input to e4m3 (per token and 128 columns), a relative error of at most 2^-4 per
    element (3 mantissa bits), about 2^-4 / sqrt(3) = 3.6% RMS. A dot product of K such inputs
    carries about that relative RMS error, and the logits sit behind chains of these GEMMs
    (q_a -> q_b -> attention -> o_proj, gate/up -> down, 3 layers) whose errors add partly
    independently: measured 6.5% RMS, 6.4% at the worst logit (6.3% and 5.6% before the block
    scales were spread: the coarser blocks change the weights, not the activations' rounding). The bound is 2^-3 = 12.5% (two
    e4m3 half-steps) for both. Selection is kept continuous for the bound to hold: index_topk
    covers the context and every expert is active, so no rounding flips a top-k choice (with
    top-2 of 8 experts a flipped choice moves a logit by 60%)."""
    root, dequantized = fp8_checkpoint(tmp_path / "fp8")
    model = GLM5ForCausalLM.from_pretrained(root, dtype=torch.float32)
    reference = GLM5ForCausalLM(FP8_TINY, dtype=torch.float32)
    reference.load_state_dict(dequantized)
    ids = tokens(PROMPT, seed=2)
    got, expected = logits(model, ids), logits(reference, ids)
    assert relative_rms(got, expected) <= 2 ** -3
    assert (got - expected).abs().max() <= 2 ** -3 * expected.abs().max()
    # the FP8 linears and experts stay FP8 in memory and run the FP8 GEMMs
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert isinstance(attn.q_b_proj, Fp8Linear) and attn.q_b_proj.weight.dtype == FP8
    assert isinstance(moe.experts, Fp8Experts) and moe.experts.gate_up_proj.dtype == FP8
    assert isinstance(attn.indexer.weights_proj, torch.nn.Linear)                # stored in float
    assert model.checkpoint_info.linear_formats == {"fp8": 54, "float": 3}
    with record_ops() as calls:
        logits(model, ids[:4])
    assert calls.counts["fp8_block_gemm"] == 27 and calls.counts["fp8_grouped_gemm"] == 4
    assert "grouped_gemm" not in calls.counts


def test_fp8_model_dtype_and_device_moves_keep_the_fp8_weights(tmp_path):
    root, _ = fp8_checkpoint(tmp_path / "fp8")
    model = GLM5ForCausalLM.from_pretrained(root)                # dtype from config.json: bfloat16
    assert model.dtype == torch.bfloat16
    q_b = model.model.layers[0].self_attn.q_b_proj
    kv_b = model.model.layers[0].self_attn.kv_b_proj
    assert kv_b.dense_weight.dtype == torch.bfloat16 and "dense_weight" not in kv_b.state_dict()
    weight = q_b.weight.clone()
    model.to(torch.float32)
    assert q_b.weight.dtype == FP8 and q_b.weight_scale_inv.dtype == torch.float32 and same_bits(q_b.weight, weight)
    assert kv_b.dense_weight.dtype == torch.float32 and model.dtype == torch.float32
    assert model.generate(tokens(6, seed=3), 3) == model.generate(tokens(6, seed=3), 3)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_linear_and_experts_compute_the_block_format(scale_fmt):
    """Against the format's definition in float64, with block scales spread over 2^-6..2^6 (so a
    scale applied to the wrong block shows) and a partial last row block (N = 200)."""
    g = torch.Generator().manual_seed(4)

    def weight(n, k):
        w = torch.randn(n, k, generator=g)
        spread = 2.0 ** torch.randint(-6, 7, (-(-n // 128), k // 128), generator=g)
        return w * spread.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)

    def fake_quant(x):               # the activations' e4m3 rounding per token and 128 columns
        blocks = x.double().view(x.shape[0], x.shape[1] // 128, 128)
        s = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
        if scale_fmt:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        return ((blocks / s).float().to(FP8).double() * s).view(x.shape)

    linear = Fp8Linear(256, 200, scale_fmt)
    q, scale, dense = fp8_blocks(weight(200, 256))
    linear.weight.copy_(q)
    linear.weight_scale_inv.copy_(scale)
    x = torch.randn(5, 256, generator=g)
    torch.testing.assert_close(linear(x), (fake_quant(x) @ dense.double().T).float(), atol=1e-4, rtol=1e-4)

    config = GLM5Config.tiny(moe_intermediate_size=128, n_routed_experts=3)
    experts = Fp8Experts(config, scale_fmt)
    dense_w = {}
    for name, (n, k) in {"gate_up_proj": (256, 256), "down_proj": (256, 128)}.items():
        parts = [fp8_blocks(weight(n, k)) for _ in range(3)]
        getattr(experts, name).copy_(torch.stack([p[0] for p in parts]))
        getattr(experts, name + "_scale_inv").copy_(torch.stack([p[1] for p in parts]))
        dense_w[name] = torch.stack([p[2] for p in parts]).double()
    rows, counts = torch.randn(7, 256, generator=g), torch.tensor([3, 0, 4], dtype=torch.int32)
    expected, start = [], 0
    for e, n in enumerate(counts.tolist()):
        gate, up = (fake_quant(rows[start:start + n]) @ dense_w["gate_up_proj"][e].T).chunk(2, -1)
        hidden = (F.silu(gate.float()) * up.float()).double()
        expected.append(fake_quant(hidden.float()) @ dense_w["down_proj"][e].T)
        start += n
    torch.testing.assert_close(experts(rows, counts), torch.cat(expected).float(), atol=1e-3, rtol=1e-3)


# -- BF16 written by HF transformers ------------------------------------------------------------------
def test_a_bf16_checkpoint_saved_by_transformers_gives_hfs_logits(tmp_path):
    """HF's GlmMoeDsaForCausalLM.save_pretrained writes the checkpoint (bf16, sharded with its
    index, cross-layer top-k sharing); from_pretrained reads it and matches the logits of HF's
    own from_pretrained of the same directory, both in float32 (1e-4 of the logits' scale, as
    tests/test_integrations_transformers.py compares them)."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GlmMoeDsaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=64,
        q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, num_experts_per_tok=2,
        index_topk=8, index_head_dim=32, index_n_heads=16, first_k_dense_replace=1, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, indexer_types=["full", "shared", "full"])
    hf = transformers.GlmMoeDsaForCausalLM(hf_config)
    # unit-scale weights (HF's own init, std 0.02, leaves attention and routing nearly uniform)
    seeded = GLM5ForCausalLM(GLM5Config.from_hf_config(hf_config.to_dict()), seed=5)
    hf.load_state_dict({**dict(seeded.named_parameters()), **dict(seeded.named_buffers())}, strict=True)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf", max_shard_size="300KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    ours = GLM5ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = tokens(PROMPT, seed=6)                       # > index_topk = 8: the indexer selects
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0]
    got = logits(ours, ids)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert GLM5ForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16     # config.json's dtype
    assert ours.model.layers[1].self_attn.indexer is None


# -- sharded round trip --------------------------------------------------------------------------------
def test_sharded_save_and_load_round_trip_exactly(tmp_path):
    model = GLM5ForCausalLM.from_pretrained(bf16_checkpoint(tmp_path / "src", eos_token_id=7), dtype=torch.bfloat16)
    written = model.save_pretrained(tmp_path / "out", max_shard_size="300KB")
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(written) == {*shards, "model.safetensors.index.json", "config.json"}
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    on_disk = file_tensors(tmp_path / "out")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in on_disk.values())
    assert all(p.stat().st_size <= 300_000 + 50_000 for p in (tmp_path / "out").glob("*.safetensors"))
    source = file_tensors(tmp_path / "src")
    assert on_disk.keys() == source.keys()
    for name, t in source.items():               # bf16 as written, the router in float32 (HF keeps it so)
        assert torch.equal(on_disk[name].to(t.dtype), t), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == 7 and config["dtype"] == "bfloat16" and "quantization_config" not in config

    loaded = GLM5ForCausalLM.from_pretrained(tmp_path / "out")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert same_bits(a, b), name
    ids = tokens(9, seed=7)
    assert torch.equal(logits(loaded, ids), logits(model, ids))

    # saving again unsharded replaces the shards: from_pretrained must not read stale files
    assert loaded.save_pretrained(tmp_path / "out") == ["model.safetensors", "config.json"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_fp8_checkpoint_saves_back_bit_for_bit(tmp_path):
    root, _ = fp8_checkpoint(tmp_path / "fp8")
    model = GLM5ForCausalLM.from_pretrained(root)
    model.save_pretrained(tmp_path / "out", max_shard_size="1MB")
    saved, source = file_tensors(tmp_path / "out"), file_tensors(root)
    assert saved.keys() == source.keys()
    for name, t in source.items():
        assert same_bits(saved[name].to(t.dtype) if t.dtype == torch.bfloat16 else saved[name], t), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"] == FP8_CONFIG


def test_save_pretrained_rejects_what_it_cannot_write(tmp_path):
    model = GLM5ForCausalLM.from_pretrained(bf16_checkpoint(tmp_path / "src"), quantize="int8")
    with pytest.raises(hal.InvalidInputError, match="INT8 W8A8"):
        model.save_pretrained(tmp_path / "out")
    for size in (0, "5 parsecs", "GB", True):
        with pytest.raises(hal.InvalidInputError, match="max_shard_size"):
            GLM5ForCausalLM(TINY, seed=0).save_pretrained(tmp_path / "out", max_shard_size=size)
    with pytest.raises(hal.InvalidInputError, match="rope_interleaved"):
        GLM5ForCausalLM(TINY.replace(rope_interleaved=False), seed=0).save_pretrained(tmp_path / "out")


# -- saving: nothing lost, nothing half written ------------------------------------------------------
def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root: its bytes and mtime (a rename keeps both, a rewrite does not)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def staging_dirs(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".saving-" in p.name]


#: save_pretrained calls that must be refused: (model from the existing checkpoint, kwargs, message)
REFUSED_SAVES = {
    "split_half_rope": (lambda root: GLM5ForCausalLM(TINY.replace(rope_interleaved=False), seed=0), {},
                        "rope_interleaved"),
    "lora_norm_eps": (lambda root: GLM5ForCausalLM(TINY.replace(lora_norm_eps=1e-5), seed=0), {}, "lora_norm_eps"),
    "float64": (lambda root: GLM5ForCausalLM(TINY, seed=0).to(torch.float64), {}, "float64"),
    "int8": (lambda root: GLM5ForCausalLM.from_pretrained(root, quantize="int8"), {}, "INT8 W8A8"),
    "max_shard_size": (lambda root: GLM5ForCausalLM(TINY, seed=0), {"max_shard_size": "5 parsecs"},
                       "max_shard_size"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSED_SAVES))
def test_a_refused_save_touches_no_file(tmp_path, refusal):
    """Every refusal comes before the first write: an existing checkpoint keeps every byte, a
    new directory is not created (before, a split-half rope was refused after the weights were
    written, and a float64 model raised a bare StopIteration after them)."""
    build, kwargs, message = REFUSED_SAVES[refusal]
    existing = bf16_checkpoint(tmp_path / "existing")
    (existing / "tokenizer.json").write_text("{}")
    model = build(existing)
    before, listing = snapshot(existing), sorted(p.name for p in tmp_path.iterdir())
    for target in (tmp_path / "new" / "deeper", existing):
        with pytest.raises(hal.InvalidInputError, match=message):
            model.save_pretrained(target, **kwargs)
    assert snapshot(existing) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing          # no new, no staging directory


def test_a_save_into_a_new_directory_appears_whole(tmp_path):
    model = GLM5ForCausalLM(TINY, seed=1, dtype=torch.bfloat16)
    assert model.save_pretrained(tmp_path / "a" / "b", max_shard_size="600KB")[-2:] == [
        "model.safetensors.index.json", "config.json"]
    assert staging_dirs(tmp_path / "a") == [] and (tmp_path / "a" / "b" / "config.json").is_file()
    assert oct((tmp_path / "a" / "b").stat().st_mode & 0o777) == oct(0o777 & ~_umask())   # not mkdtemp's 0700


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_save_into_a_checkpoint_directory_replaces_only_its_own_files(tmp_path):
    root = tmp_path / "ckpt"
    GLM5ForCausalLM(TINY, seed=1, dtype=torch.bfloat16).save_pretrained(root, max_shard_size="600KB")
    others = {"tokenizer.json": b"{}", "README.md": b"# notes", "assets/vocab.txt": b"a\nb"}
    for name, data in others.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(data)
    kept = {n: v for n, v in snapshot(root).items() if n in others}
    new = GLM5ForCausalLM(TINY, seed=2, dtype=torch.bfloat16)
    assert new.save_pretrained(root) == ["model.safetensors", "config.json"]
    assert sorted(p.name for p in root.iterdir()) == ["README.md", "assets", "config.json", "model.safetensors",
                                                       "tokenizer.json"]
    assert {n: v for n, v in snapshot(root).items() if n in others} == kept
    assert staging_dirs(tmp_path) == []
    loaded = GLM5ForCausalLM.from_pretrained(root).state_dict()
    assert all(same_bits(loaded[n], t) for n, t in new.state_dict().items())


def _loads(root: Path, candidates: dict[str, dict]) -> str:
    """Which of the candidate state dicts the directory loads as: its label, "refused" (an
    InvalidInputError), or "mixed"."""
    try:
        loaded = GLM5ForCausalLM.from_pretrained(root).state_dict()
    except hal.InvalidInputError:
        return "refused"
    return next((label for label, state in candidates.items()
                 if all(same_bits(loaded[n], t) for n, t in state.items())), "mixed")


@pytest.mark.parametrize("old_shards, new_shards", [("600KB", "5GB"), ("5GB", "600KB"), ("600KB", "400KB")])
def test_every_step_of_a_save_over_a_checkpoint_loads_the_old_the_new_or_nothing(tmp_path, monkeypatch,
                                                                                   old_shards, new_shards):
    """The save into an existing directory moves files one rename at a time; before each rename
    the directory is loaded: it is the complete old checkpoint, the complete new one, or refused
    (no weights entry point), never a mix (a crash at any point leaves one of these)."""
    root = tmp_path / "ckpt"
    old, new = (GLM5ForCausalLM(TINY, seed=s, dtype=torch.bfloat16) for s in (1, 2))
    old.save_pretrained(root, max_shard_size=old_shards)
    states = {"old": old.state_dict(), "new": new.state_dict()}
    seen, rename = [], os.replace

    def observed_replace(src, dst):
        seen.append(_loads(root, states))
        rename(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", observed_replace)
        new.save_pretrained(root, max_shard_size=new_shards)
    seen.append(_loads(root, states))
    assert len(seen) >= 4 and seen[0] == "old" and seen[-1] == "new", seen
    assert set(seen) <= {"old", "new", "refused"}, seen
    assert staging_dirs(tmp_path) == []


def test_a_save_failing_while_writing_leaves_the_directory_untouched(tmp_path, monkeypatch):
    """A full disk at the second shard: the old checkpoint keeps every byte (before, the first
    shard had already overwritten the old one's)."""
    from glm5_hal.models import checkpoint
    root = tmp_path / "ckpt"
    GLM5ForCausalLM(TINY, seed=1, dtype=torch.bfloat16).save_pretrained(root, max_shard_size="600KB")
    (root / "tokenizer.json").write_text("{}")
    before, real, written = snapshot(root), checkpoint.save_file, []

    def disk_full_at_the_second_file(tensors, filename, metadata=None):
        if written:
            raise OSError(28, "No space left on device (injected)")
        written.append(filename)
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", disk_full_at_the_second_file)
    with pytest.raises(OSError, match="injected"):
        GLM5ForCausalLM(TINY, seed=2, dtype=torch.bfloat16).save_pretrained(root, max_shard_size="600KB")
    assert snapshot(root) == before and staging_dirs(tmp_path) == []


def test_a_save_failing_before_its_commit_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    old = GLM5ForCausalLM(TINY, seed=1, dtype=torch.bfloat16)
    old.save_pretrained(root, max_shard_size="600KB")
    (root / "tokenizer.json").write_text("{}")
    before, rename = snapshot(root), os.replace

    def failing_commit(src, dst):
        if Path(dst) == root / "model.safetensors":
            raise OSError(5, "I/O error (injected)")
        rename(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", failing_commit)
        with pytest.raises(OSError, match="injected"):
            GLM5ForCausalLM(TINY, seed=2, dtype=torch.bfloat16).save_pretrained(root)
    assert snapshot(root) == before and staging_dirs(tmp_path) == []
    assert _loads(root, {"old": old.state_dict()}) == "old"


def test_an_interrupted_save_of_another_layout_is_refused_naming_both_files(tmp_path):
    """Shards + index next to a model.safetensors (what an interrupted sharded save over a
    single-file checkpoint left before): either could be stale, so neither is read (before,
    model.safetensors was, silently the old weights)."""
    root = tmp_path / "ckpt"
    GLM5ForCausalLM(TINY, seed=1, dtype=torch.bfloat16).save_pretrained(root, max_shard_size="600KB")
    stale = bf16_checkpoint(tmp_path / "stale", seed=2)
    (root / "model.safetensors").write_bytes((stale / "model.safetensors").read_bytes())
    with pytest.raises(hal.InvalidInputError, match=r"both model\.safetensors and model\.safetensors\.index\.json"):
        GLM5ForCausalLM.from_pretrained(root)


# -- hostile checkpoints: files outside the directory ---------------------------------------------------
def _index_to(root: Path, file: str, names) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: file for n in names}}))


def test_index_entries_must_resolve_inside_the_checkpoint_directory(tmp_path):
    outside = bf16_checkpoint(tmp_path / "other", seed=3)
    names = sorted(file_tensors(outside))
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_bytes((outside / "config.json").read_bytes())
    for file in ("../other/model.safetensors", str(outside / "model.safetensors"), "sub/../../other/model.safetensors",
                 "C:\\weights\\model.safetensors"):
        _index_to(root, file, names)
        error = _raises_naming(root, names[0], "inside the checkpoint directory")
        assert error.file == "model.safetensors.index.json" and repr(file) in str(error)
    # a link inside the directory that leads out of it
    (root / "model-00001-of-00001.safetensors").symlink_to(outside / "model.safetensors")
    _index_to(root, "model-00001-of-00001.safetensors", names)
    _raises_naming(root, names[0], "must not lead outside")
    (root / "model.safetensors.index.json").unlink()
    (root / "model.safetensors").symlink_to(outside / "model.safetensors")
    _raises_naming(root, "model.safetensors", "must not lead outside")
    # a link that stays inside is a file like any other
    (root / "model.safetensors").unlink()
    (root / "model-00001-of-00001.safetensors").unlink()
    (root / "blob").write_bytes((outside / "model.safetensors").read_bytes())
    (root / "model.safetensors").symlink_to("blob")
    assert GLM5ForCausalLM.from_pretrained(root).checkpoint_info.files == ["model.safetensors"]


def test_a_hugging_face_cache_snapshot_whose_links_point_into_blobs_loads(tmp_path):
    """The hub's cache keeps a snapshot's files as links to ../../blobs/<hash>: those are the
    one way out of the directory a checkpoint may take."""
    source = bf16_checkpoint(tmp_path / "source")
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot_dir = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot_dir.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        (repo / "blobs" / f"blob{i}").write_bytes((source / name).read_bytes())
        (snapshot_dir / name).symlink_to(f"../../blobs/blob{i}")
    assert GLM5ForCausalLM.from_pretrained(snapshot_dir).checkpoint_info.tensors > 0


# -- hostile checkpoints: modules_to_not_convert ----------------------------------------------------------
def _fp8_config(*skip) -> dict:
    return {**FP8_CONFIG, "modules_to_not_convert": list(skip)}


def test_modules_to_not_convert_is_matched_as_transformers_matches_it():
    """Against transformers' own should_convert_module (quantizers/quantizers_utils.py) on every
    module of the FP8 model and GLM-5-sized names: prefixes at a module boundary, regular
    expressions, suffixes."""
    from glm5_hal.models.checkpoint import fp8_scheme
    transformers_utils = pytest.importorskip("transformers.quantizers.quantizers_utils")
    with torch.device("meta"):
        names = [p for p, _ in GLM5ForCausalLM(FP8_TINY).named_modules() if p]
    names += [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (3, 12, 77, 78) for e in (0, 9, 123, 255)
              for p in ("gate_proj", "up_proj", "down_proj")]
    keys = ["lm_head", "self_attn.o_proj", "model.layers.1", "model.layers.1.mlp", "layers.*.mlp.gate",
            r"model\.layers\.\d+\.self_attn\.kv_b_proj", "mlp.experts.[0-3].down_proj", "(q|kv)_a_proj",
            "model.layers.1.mlp.experts.", "experts", "gate", ".*indexer.*", "model.layers.(0|2)", "mlp.gate$",
            "^model", "indexer.weights_proj", "model.layers.1[0-9]?", r"model\.layers\.(?:7[0-9])\.mlp",
            "model.layers.12.mlp.experts.1", "[^.]+.layers.3", "model.layers.7.*?proj", "model.layers.{2}"]
    for key in keys:
        scheme = fp8_scheme(_fp8_config(key))
        for name in names:
            assert scheme.converts(name) == transformers_utils.should_convert_module(name, [key]), (key, name)


def test_a_catastrophic_modules_to_not_convert_pattern_is_matched_in_linear_time():
    """`(.*)*X` takes exponential time in Python's backtracking re (13 s at 28 characters, GLM-5's
    module names have 33-60): a child process must finish matching 84-character names long
    before the timeout (it takes milliseconds; the backtracking engine would take ages)."""
    code = ("from glm5_hal.models.checkpoint import fp8_scheme\n"
            "s = fp8_scheme({'quant_method': 'fp8', 'modules_to_not_convert': ['(.*)*X', '(x+x+)+y', '(a|a)*b']})\n"
            "print(s.converts('model.layers.12.mlp.experts.123.gate_proj.' * 2))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr[-2000:]


@pytest.mark.parametrize("key", [r"(a)\1", "(?=model)", "(?i)LM_HEAD", "a{1000}", "(unclosed", "mlp)|(gate",
                                 r"\bgate", "x" * 1001])
def test_a_modules_to_not_convert_key_outside_the_safe_syntax_is_named(key):
    from glm5_hal.models.checkpoint import fp8_scheme
    with pytest.raises(CheckpointError, match=r"quantization_config\.modules_to_not_convert\[1\]'") as info:
        fp8_scheme(_fp8_config("lm_head", key))
    assert info.value.field == "quantization_config.modules_to_not_convert[1]" and info.value.file == "config.json"


# -- hostile checkpoints: malformed values ------------------------------------------------------------
@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    return bf16_checkpoint(tmp_path_factory.mktemp("small") / "ckpt")


def _malformed_values() -> list[tuple[str, object]]:
    """(config.json key, a malformed value) for every key the loader reads: each key a wrong
    JSON type or two, and out-of-range values where the key has a range."""
    from glm5_hal.models import hf_config
    out = []
    for key, (expected, _) in hf_config._FIELD_TYPES.items():
        if expected == "a string":
            out += [(key, 5), (key, ["x"])]
        elif expected == "true or false":
            out += [(key, "x"), (key, 1)]
        else:
            out += [(key, "x" if "string" not in expected else 5), (key, [1])]
            out += [(key, {"a": 1})] if "object" not in expected else []
        if expected in ("an int", "a finite number", "a finite number > 0"):
            out += [(key, True)]
        if key not in hf_config._NULLABLE:
            out.append((key, None))
    out += [("num_hidden_layers", 0), ("hidden_size", -256), ("first_k_dense_replace", 99), ("qk_rope_head_dim", 15),
            ("rms_norm_eps", -1e-5), ("rope_parameters.rope_theta", -1.0), ("rope_parameters.rope_type", "yarn"),
            ("model_type", "llama"), ("hidden_act", "gelu"), ("mlp_layer_types", ["sparse", "sparse", "sparse"]),
            ("indexer_types", ["shared", "full", "full"]), ("index_topk_pattern", "FXS"), ("q_lora_rank", 0)]
    out += [("num_nextn_predict_layers", v) for v in ("x", -1, True, 1.5, [1])]
    out += [("dtype", ["bfloat16"]), ("dtype", 16), ("dtype", "int8"), ("torch_dtype", {"a": 1})]
    out += [("quantization_config", "fp8"), ("quantization_config", [FP8_CONFIG]),
            ("quantization_config.weight_block_size", ["128", "128"]),
            ("quantization_config.weight_block_size", [128, 128, 128]), ("quantization_config.scale_fmt", ["ue8m0"]),
            ("quantization_config.quant_method", ["fp8"]), ("quantization_config.fmt", {"e4m3": 1}),
            ("quantization_config.activation_scheme", 0), ("quantization_config.modules_to_not_convert", "lm_head"),
            ("quantization_config.modules_to_not_convert", [5]), ("quantization_config.dequantize", "no")]
    out += [("weight_map", []), ("weight_map", {}), ("weight_map.model.norm.weight", 5),
            ("weight_map.model.norm.weight", None), ("weight_map.model.norm.weight", ["a.safetensors"])]
    return out


def _with_value(hf: dict, key: str, value) -> None:
    if key.startswith("rope_parameters."):
        hf["rope_parameters"] = {**hf["rope_parameters"], key.split(".", 1)[1]: value}
    elif key.startswith("quantization_config."):
        hf["quantization_config"] = {**FP8_CONFIG, key.split(".", 1)[1]: value}
    else:
        hf[key] = value


@pytest.mark.parametrize("key, value", _malformed_values(), ids=lambda v: repr(v)[:40])
def test_a_malformed_config_value_is_a_checkpoint_error_naming_its_key(tmp_path, small_checkpoint, key, value):
    """Before, `num_nextn_predict_layers: "x"`, a list for `dtype` or a non-string weight_map value
    raised a raw ValueError / TypeError, and some (`routed_scaling_factor: "x"`) loaded."""
    root = tmp_path / "ckpt"
    root.mkdir()
    hf = json.loads((small_checkpoint / "config.json").read_text())
    if key.startswith("weight_map"):
        weight_map = value if key == "weight_map" else {"model.norm.weight": value}
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        _with_value(hf, key, value)
        os.link(small_checkpoint / "model.safetensors", root / "model.safetensors")
    (root / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError) as info:
        GLM5ForCausalLM.from_pretrained(root)
    error = info.value
    assert error.field == key and f"field '{key}'" in str(error), str(error)
    assert error.file == ("model.safetensors.index.json" if key.startswith("weight_map") else "config.json")


#: Every key a GLM-5 config.json (transformers' GlmMoeDsaConfig, FineGrainedFP8Config) or the
#: loader's documentation names, and the index's.
CONFIG_KEYS = sorted({
    "_name_or_path", "architectures", "attention_bias", "attention_dropout", "bos_token_id", "dtype", "eos_token_id",
    "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size", "index_head_dim", "index_n_heads", "index_topk",
    "indexer_types", "initializer_range", "intermediate_size", "kv_lora_rank", "layer_types", "max_position_embeddings",
    "mlp_bias", "mlp_layer_types", "model_type", "moe_intermediate_size", "n_group", "n_routed_experts",
    "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
    "num_key_value_heads", "pad_token_id", "q_lora_rank", "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
    "rms_norm_eps", "rope_parameters", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "use_cache",
    "v_head_dim", "vocab_size", "torch_dtype", "rope_theta", "index_topk_pattern", "index_topk_freq",
    "index_skip_topk_offset", "num_nextn_predict_layers", "quantization_config", "rope_parameters.rope_type",
    "rope_parameters.type", "rope_parameters.rope_theta"} | {f"quantization_config.{k}" for k in (
        "activation_scheme", "dequantize", "expert_dtype", "modules_to_convert", "modules_to_not_convert",
        "ignored_layers", "quant_method", "scale_fmt", "weight_block_size", "fmt")})


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_every_config_key_the_loader_reads_is_validated(monkeypatch, small_checkpoint, key):
    """The key set to a value no JSON holds (a bare object(): not a number, string, list or
    mapping, never equal to anything): the loader either does not read the key, or names it in
    a CheckpointError. A key read without validation fails here with the TypeError /
    AttributeError its use raises, whichever key a future change starts reading."""
    from glm5_hal.models import checkpoint
    hf = json.loads((small_checkpoint / "config.json").read_text())
    _with_value(hf, key, object())
    read_json = checkpoint._read_json
    monkeypatch.setattr(checkpoint, "_read_json", lambda path: hf if path.name == "config.json" else read_json(path))
    try:
        GLM5ForCausalLM.from_pretrained(small_checkpoint)
    except CheckpointError as e:
        assert e.field == key, str(e)


def test_a_config_override_stays_an_error_naming_the_override(tmp_path, small_checkpoint):
    with pytest.raises(hal.InvalidInputError, match="argument 'attention'") as info:
        GLM5ForCausalLM.from_pretrained(small_checkpoint, attention="sideways")
    assert not isinstance(info.value, CheckpointError)


# -- errors -------------------------------------------------------------------------------------------
def _edited(tmp_path, edit, config: GLM5Config = TINY, quantization_config=None, fp8: bool = False) -> Path:
    if fp8:
        root, _ = fp8_checkpoint(tmp_path / "base")
        tensors, qc = file_tensors(root), FP8_CONFIG
        config = FP8_TINY
    else:
        tensors, qc = GLM5ForCausalLM(config, seed=1, dtype=torch.bfloat16).state_dict(), None
    edit(tensors)
    return write_checkpoint(tmp_path / "edited", config, tensors, quantization_config or qc)


def _raises_naming(path: Path, tensor: str, message: str, **kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError, match=message) as info:
        GLM5ForCausalLM.from_pretrained(path, **kwargs)
    assert info.value.tensor == tensor and f"'{tensor}'" in str(info.value)
    assert isinstance(info.value, hal.InvalidInputError) and isinstance(info.value, ValueError)
    return info.value


def test_a_missing_tensor_is_named(tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    error = _raises_naming(_edited(tmp_path, lambda t: t.pop(name)), name, "missing")
    assert error.file is None


def test_an_unknown_tensor_is_named_with_its_file(tmp_path):
    name = "model.layers.1.self_attn.indexer.wk.weight"           # layer 1 shares its top-k: no indexer
    path = _edited(tmp_path, lambda t: t.update({name: torch.zeros(32, 256, dtype=torch.bfloat16)}))
    assert _raises_naming(path, name, "model.safetensors.*does not have").file == "model.safetensors"


def test_a_wrong_shape_is_named(tmp_path):
    name = "model.layers.0.self_attn.q_b_proj.weight"
    path = _edited(tmp_path, lambda t: t.update({name: t[name][:, :32]}))
    _raises_naming(path, name, r"shape \[192, 64\], got \[192, 32\]")


def test_wrong_dtypes_and_formats_are_named(tmp_path):
    name = "model.norm.weight"
    path = _edited(tmp_path / "int", lambda t: t.update({name: t[name].to(torch.int32)}))
    _raises_naming(path, name, "float dtype, got I32")
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"     # an FP8 weight without its scale
    _raises_naming(_edited(tmp_path / "noscale", lambda t: t.pop(scale), fp8=True), scale, "missing")
    # FP8 tensors while config.json has no quantization_config
    root, _ = fp8_checkpoint(tmp_path / "noconfig")
    hf = json.loads((root / "config.json").read_text())
    del hf["quantization_config"]
    (root / "config.json").write_text(json.dumps(hf))
    _raises_naming(root, "model.layers.0.self_attn.q_a_proj.weight", "no FP8 quantization_config")
    # one expert in float among FP8 experts
    expert = "model.layers.1.mlp.experts.2.down_proj"

    def dequantize_one_expert(t):
        t[expert + ".weight"] = t[expert + ".weight"].float()
        del t[expert + ".weight_scale_inv"]
    _raises_naming(_edited(tmp_path / "mixed", dequantize_one_expert, fp8=True), expert + ".weight",
                   "stacked in one format")


def test_fp8_layers_whose_input_is_not_128_blocks_are_refused(tmp_path):
    config = FP8_TINY.replace(q_lora_rank=64)                  # q_b_proj's input: 64 columns
    root, _ = fp8_checkpoint(tmp_path / "fp8", config)
    _raises_naming(root, "model.layers.0.self_attn.q_b_proj.weight", "multiple of 128.*got 64")
    assert GLM5ForCausalLM.from_pretrained(root, quantize="int8").generate([1, 2, 3], 2)    # INT8 takes any K


@pytest.mark.parametrize("field, value", [
    ("quant_method", "gptq"), ("fmt", "e5m2"), ("weight_block_size", [64, 64]), ("activation_scheme", "static"),
    ("scale_fmt", "e8m0_bytes"), ("modules_to_convert", ["model.embed_tokens"])])
def test_an_unsupported_quantization_config_is_named(tmp_path, field, value):
    root, _ = fp8_checkpoint(tmp_path / "fp8")
    hf = json.loads((root / "config.json").read_text())
    hf["quantization_config"][field] = value
    (root / "config.json").write_text(json.dumps(hf))
    message = rf"quantization_config\.{field}': expected .*got {re.escape(repr(value))}"
    with pytest.raises(hal.InvalidInputError, match=message):
        GLM5ForCausalLM.from_pretrained(root)


def test_modules_to_not_convert_is_honoured(tmp_path):
    root, _ = fp8_checkpoint(tmp_path / "fp8")
    hf = json.loads((root / "config.json").read_text())
    hf["quantization_config"]["modules_to_not_convert"] = ["lm_head", "self_attn.o_proj"]
    (root / "config.json").write_text(json.dumps(hf))
    _raises_naming(root, "model.layers.0.self_attn.o_proj.weight", "modules_to_not_convert")


def test_directory_and_argument_errors(tmp_path):
    with pytest.raises(hal.InvalidInputError, match="path"):
        GLM5ForCausalLM.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    with pytest.raises(hal.InvalidInputError, match="model.safetensors or model.safetensors.index.json"):
        GLM5ForCausalLM.from_pretrained(tmp_path / "empty")
    root = bf16_checkpoint(tmp_path / "ok")
    with pytest.raises(hal.InvalidInputError, match="quantize"):
        GLM5ForCausalLM.from_pretrained(root, quantize="int4")
    with pytest.raises(hal.InvalidInputError, match="dtype"):
        GLM5ForCausalLM.from_pretrained(root, dtype=torch.int8)
    # an index naming a file that is not there
    model = GLM5ForCausalLM.from_pretrained(root)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    index_file = tmp_path / "sharded" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files = list(index["weight_map"].values())
    name, file = next((n, f) for n, f in index["weight_map"].items() if files.count(f) > 1)
    index["weight_map"].pop(name)
    index_file.write_text(json.dumps(index))
    _raises_naming(tmp_path / "sharded", name, "listed in model.safetensors.index.json")
    index["weight_map"][name] = "model-00013-of-00013.safetensors" if file != "model-00013-of-00013.safetensors" \
        else "model-00001-of-00013.safetensors"
    index_file.write_text(json.dumps(index))
    _raises_naming(tmp_path / "sharded", name, "where model.safetensors.index.json puts it")
    index["weight_map"][name] = file
    index_file.write_text(json.dumps(index))
    (tmp_path / "sharded" / "model-00002-of-00013.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00013.safetensors.*no such file"):
        GLM5ForCausalLM.from_pretrained(tmp_path / "sharded")


# -- the MTP layer --------------------------------------------------------------------------------------
def test_mtp_layer_tensors_are_skipped_with_a_note(tmp_path):
    mtp = {"model.layers.3.enorm.weight": torch.ones(256), "model.layers.3.eh_proj.weight": torch.zeros(256, 512),
           "model.layers.3.self_attn.q_a_proj.weight": torch.zeros(64, 256)}
    path = _edited(tmp_path, lambda t: t.update({k: v.bfloat16() for k, v in mtp.items()}))
    with pytest.warns(SkippedTensorsWarning, match=r"3 tensors of the multi-token-prediction layer model\.layers\.3"):
        model = GLM5ForCausalLM.from_pretrained(path)
    assert model.checkpoint_info.skipped == sorted(mtp)
    beyond = "model.layers.4.enorm.weight"                     # num_nextn_predict_layers defaults to 1
    path = _edited(tmp_path / "beyond", lambda t: t.update({beyond: torch.ones(256)}))
    _raises_naming(path, beyond, "does not have")


# -- INT8 W8A8 at load ----------------------------------------------------------------------------------
def test_int8_conversion_runs_the_int8_gemms_and_tracks_the_float_model(tmp_path):
    """quantize="int8" against the same checkpoint in float32. Per-token activation and
    per-channel weight scales round each operand to a step of amax / 127: for unit-scale
    Gaussian rows (amax ~ 3.5 sigma) an RMS error of 3.5 / 127 / sqrt(12) = 0.8% of sigma per
    operand, ~1.1% per GEMM, which the chained GEMMs of 3 layers grow to the measured 3% RMS
    at the logits. Bound: 6%. (Selection continuous as in the FP8 test.)"""
    root, _ = fp8_checkpoint(tmp_path / "fp8")
    path = bf16_checkpoint(tmp_path / "bf16", FP8_TINY)
    int8 = GLM5ForCausalLM.from_pretrained(path, dtype=torch.float32, quantize="int8")
    full = GLM5ForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokens(PROMPT, seed=8)
    assert relative_rms(logits(int8, ids), logits(full, ids)) <= 0.06
    attn = int8.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, Int8Linear) and attn.q_a_proj.weight.dtype == torch.int8
    assert isinstance(int8.model.layers[1].mlp.experts, Int8Experts)
    assert type(attn.kv_b_proj) is torch.nn.Linear and type(attn.indexer.weights_proj) is torch.nn.Linear
    with record_ops() as calls:
        logits(int8, ids[:4])
    assert calls.counts["int8_gemm"] == 27 and calls.counts["int8_grouped_gemm"] == 4
    # from an FP8 checkpoint: dequantized, then converted
    from_fp8 = GLM5ForCausalLM.from_pretrained(root, dtype=torch.float32, quantize="int8")
    assert from_fp8.checkpoint_info.linear_formats == {"int8": 51, "float": 6}
    assert relative_rms(logits(from_fp8, ids), logits(full, ids)) <= 0.15


def test_int8_conversion_dequantizes_every_fp8_block_with_its_own_scale(tmp_path):
    """quantize="int8" of an FP8 checkpoint, weight by weight against the test's own
    dequantization (fp8_blocks): every int8 row times its scale is the dequantized row within
    half a quantization step (plus float32 rounding), and the weights kept float (kv_b_proj,
    FP8's dense_weight) equal it exactly. The block scales differ by up to 2^10 within a weight,
    so a scale grid read transposed or shifted moves weights by orders of magnitude."""
    root, dequantized = fp8_checkpoint(tmp_path / "fp8")
    int8 = GLM5ForCausalLM.from_pretrained(root, dtype=torch.float32, quantize="int8")
    pairs = []                       # (checkpoint name, int8 codes, per-row scales)
    for path, module in int8.named_modules():
        if isinstance(module, Int8Linear):
            pairs.append((path + ".weight", module.weight, module.weight_scale))
        elif isinstance(module, Int8Experts):
            views = dict(expert_views(module, path + "."))
            pairs += [(name, view, views[name + "_scale"]) for name, view in views.items() if name.endswith(".weight")]
    assert len(pairs) == 51
    for name, q, scale in pairs:
        step = scale.double()[:, None]
        error = (q.double() * step - dequantized[name].double()).abs()
        # half a step, plus the float32 rounding of w / step (|w / step| <= 127: 2^-17 steps)
        assert bool((error <= (0.5 + 2 ** -16) * step).all()), name
    kept = {p: m.weight for p, m in int8.named_modules() if p.endswith("kv_b_proj")}
    assert len(kept) == 3 and all(torch.equal(w, dequantized[p + ".weight"]) for p, w in kept.items())
    fp8 = GLM5ForCausalLM.from_pretrained(root, dtype=torch.float32)
    dense = {p: m.dense_weight for p, m in fp8.named_modules() if p.endswith("kv_b_proj")}
    assert len(dense) == 3 and all(torch.equal(w, dequantized[p + ".weight"]) for p, w in dense.items())


def test_fp8_test_checkpoints_spread_their_block_scales_over_orders_of_magnitude(tmp_path):
    """What makes the test above see a misplaced scale: the scales span three orders of
    magnitude, and within most weights of several blocks they differ by 2x or more."""
    root, _ = fp8_checkpoint(tmp_path / "fp8")
    scales = [t for n, t in file_tensors(root).items() if n.endswith("weight_scale_inv")]
    assert float(max(t.max() for t in scales) / min(t.min() for t in scales)) >= 1000
    ratios = [float(t.max() / t.min()) for t in scales if t.numel() > 1]
    assert sum(r >= 2 for r in ratios) >= 0.75 * len(ratios)


# -- the demo -------------------------------------------------------------------------------------------
def test_demo_generates_from_a_checkpoint(tmp_path, capsys):
    root, _ = fp8_checkpoint(tmp_path / "fp8")
    assert cli.main(["demo", "--checkpoint", str(root), "--tokens", "3", "--prompt-ids", "5,6,7,8"]) == 0
    out = capsys.readouterr().out
    assert f"the model of {root}" in out and "FP8 checkpoint" in out and "54 FP8" in out
    assert "prompt (4 tokens): 5 6 7 8" in out
    generated = next(line for line in out.splitlines() if line.startswith("generated"))
    assert len(generated.split(":")[1].split()) == 3
    for op in ("fp8_block_gemm", "fp8_block_quant", "fp8_grouped_gemm"):
        assert op in out
    assert cli.main(["demo", "--checkpoint", str(root), "--tokens", "2", "--quantize", "int8"]) == 0
    assert "int8_grouped_gemm" in capsys.readouterr().out
    assert cli.main(["demo", "--checkpoint", str(tmp_path / "missing"), "--tokens", "2"]) == 2
    assert "missing" in capsys.readouterr().err
    assert cli.main(["demo", "--checkpoint", str(root), "--prompt", "hello"]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_demo_encodes_and_decodes_with_the_checkpoints_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from glm5_hal.models import demo
    root = bf16_checkpoint(tmp_path / "bf16")
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world"] + [f"w{i}" for i in range(509)])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))
    out = io.StringIO()
    result = demo.run(tokens=2, checkpoint=root, prompt="hello world w7", out=out)
    assert result["prompt"] == [1, 2, 10]
    assert "prompt text: 'hello world w7'" in out.getvalue() and "generated text: " in out.getvalue()
