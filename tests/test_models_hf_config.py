"""GLM5Config.from_hf_config: an HF glm_moe_dsa config.json read without transformers, checked
against transformers' own GlmMoeDsaConfig where it is installed (a pinned test dependency)."""
from __future__ import annotations

import json

import pytest

import glm5_hal as hal
from glm5_hal.models import GLM5Config
from glm5_hal.models.hf_config import HF_DEFAULTS

TINY_HF = dict(
    model_type="glm_moe_dsa", vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
    num_experts_per_tok=2, index_topk=8, index_head_dim=32, index_n_heads=16, first_k_dense_replace=1,
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    indexer_types=["full", "shared", "shared", "full"])


def test_a_config_json_maps_onto_the_model_config(tmp_path):
    config = GLM5Config.from_hf_config(TINY_HF)
    assert config == GLM5Config.tiny(num_layers=4, name="glm_moe_dsa",
                                     indexer_types=("full", "shared", "shared", "full"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    assert GLM5Config.from_hf_config(tmp_path) == config                     # the checkpoint folder
    assert GLM5Config.from_hf_config(tmp_path / "config.json") == config
    assert GLM5Config.from_hf_config(TINY_HF, attention="dense").attention == "dense"   # overrides


def test_indexer_types_follow_hf_patterns_and_schedules():
    base = {k: v for k, v in TINY_HF.items() if k != "indexer_types"}
    assert GLM5Config.from_hf_config(base).indexer_types == ("full",) * 4
    assert GLM5Config.from_hf_config({**base, "index_topk_pattern": "FSFS"}).indexer_types == (
        "full", "shared", "full", "shared")
    # HF's schedule: layer i is full when max(i - offset + 1, 0) % freq == 0
    assert GLM5Config.from_hf_config({**base, "index_topk_freq": 2, "index_skip_topk_offset": 2}).indexer_types == (
        "full", "full", "shared", "full")


def test_unrepresentable_fields_are_rejected_not_ignored(tmp_path):
    cases = {"model_type": "deepseek_v32", "hidden_act": "gelu", "attention_bias": True, "tie_word_embeddings": True,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
             "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"],
             "indexer_types": ["shared", "full", "full", "full"]}
    for field, value in cases.items():
        with pytest.raises(hal.InvalidInputError, match=field):
            GLM5Config.from_hf_config({**TINY_HF, field: value})
    with pytest.raises(hal.InvalidInputError, match="source.*readable config.json"):
        GLM5Config.from_hf_config(tmp_path / "missing.json")
    with pytest.raises(hal.InvalidInputError, match="source"):
        GLM5Config.from_hf_config(42)


@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", "4"), ("hidden_size", 256.0), ("q_lora_rank", None), ("norm_topk_prob", "yes"),
    ("routed_scaling_factor", "2.5"), ("rms_norm_eps", float("nan")), ("rope_theta", [1e6]),
    ("rope_parameters", ["default"]), ("rope_parameters.rope_theta", "1e6"), ("mlp_layer_types", "dense"),
    ("indexer_types", 3), ("index_topk_pattern", "FSXF"), ("index_topk_freq", None), ("_name_or_path", 7),
    ("vocab_size", True)])
def test_a_field_of_the_wrong_type_is_named_not_a_type_error(field, value):
    """Each read field's JSON type is checked before use (before, `"4"` layers or a list rope
    raised TypeError / AttributeError, and a string scaling factor was accepted)."""
    hf = dict(TINY_HF)
    if field.startswith("rope_parameters."):
        hf["rope_parameters"] = {"rope_type": "default", field.split(".")[1]: value}
    else:
        hf[field] = value
    with pytest.raises(hal.InvalidInputError) as info:
        GLM5Config.from_hf_config(hf)
    assert info.value.arg == field and f"'{field}'" in str(info.value)


def test_defaults_and_derivations_match_transformers():
    transformers = pytest.importorskip("transformers")
    hf = transformers.GlmMoeDsaConfig()
    for field, value in HF_DEFAULTS.items():
        expected = hf.rope_parameters["rope_theta"] if field == "rope_theta" else getattr(hf, field)
        assert value == expected, field
    # an empty config.json is GLM-5 at HF's defaults
    assert GLM5Config.from_hf_config({}) == GLM5Config.from_hf_config(hf)
    assert GLM5Config.from_hf_config({}).replace(name="glm5", rope_theta=1e6, indexer_types=None) == GLM5Config.glm5()
    for extra in ({"index_topk_pattern": "FSSF"}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                  {"index_topk_freq": 2}):
        hf = transformers.GlmMoeDsaConfig(num_hidden_layers=4, **extra)
        assert GLM5Config.from_hf_config(hf.to_dict()).indexer_types == tuple(hf.indexer_types), extra


def test_to_hf_config_reads_back_and_transformers_takes_it():
    config = GLM5Config.from_hf_config(TINY_HF)
    written = config.to_hf_config()
    assert written["model_type"] == "glm_moe_dsa" and written["num_hidden_layers"] == 4
    assert written["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    assert GLM5Config.from_hf_config(json.loads(json.dumps(written))) == config
    for field, value in {"rope_interleaved": False, "indexer_rope_interleaved": False, "lora_norm_eps": 1e-5,
                         "indexer_norm_eps": 1e-5}.items():
        with pytest.raises(hal.InvalidInputError, match=field):
            config.replace(**{field: value}).to_hf_config()
    transformers = pytest.importorskip("transformers")
    hf = transformers.GlmMoeDsaConfig(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert GLM5Config.from_hf_config(hf.to_dict()) == config
