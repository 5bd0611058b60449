"""Reading an HF `glm_moe_dsa` config (config.json) into a `GLM5Config`, without transformers.

Field names, defaults and the `indexer_types` derivation are those of transformers'
`GlmMoeDsaConfig` (src/transformers/models/glm_moe_dsa/configuration_glm_moe_dsa.py, read in
transformers 5.23.0 and 5.24.0). A saved config.json may omit fields equal to the class
defaults, so a missing field takes HF's default, not the tiny model's.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping

from ..errors import InvalidInputError

_OP = "GLM5Config.from_hf_config"

#: GlmMoeDsaConfig's defaults for every field this model reads (GLM-5's dimensions; the rope
#: base is PreTrainedConfig's default 10000 when `rope_parameters` is absent).
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
    v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
    norm_topk_prob=True, rms_norm_eps=1e-5, index_topk=2048, index_head_dim=128,
    index_n_heads=32, first_k_dense_replace=3, hidden_act="silu", attention_bias=False,
    tie_word_embeddings=False, rope_theta=10000.0)

# HF name -> GLM5Config name, for the fields copied as they are
_RENAMED = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
            "first_k_dense_replace": "first_dense_layers"}
_COPIED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "n_shared_experts",
           "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
           "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob",
           "rms_norm_eps", "index_topk", "index_head_dim", "index_n_heads")


def glm5_config_from_hf(config_cls: type, source: "Mapping[str, Any] | str | os.PathLike | Any",
                        **overrides) -> Any:
    """A `config_cls` (GLM5Config) from an HF `glm_moe_dsa` config: a dict (config.json's contents), the path
    of a config.json or of the folder holding it, or a transformers config object
    (`.to_dict()`). `overrides` replace fields of the result (e.g. `attention="dense"`).

    The HF-only fields this model cannot represent raise InvalidInputError instead of being
    ignored: another `model_type`, an activation other than silu, attention biases, tied
    embeddings, a rope scaling other than "default", an MLP layer pattern other than
    `first_k_dense_replace` dense layers first. Both ropes are interleaved, as in HF's
    `glm_moe_dsa` modeling code (`apply_rotary_pos_emb_interleave` for MLA and the indexer).
    """
    given = _as_dict(source)
    _check_types(given)
    hf = {**HF_DEFAULTS, **given}
    _expect("model_type", hf.get("model_type", "glm_moe_dsa"), "'glm_moe_dsa'", lambda v: v == "glm_moe_dsa")
    _expect("hidden_act", hf["hidden_act"], "'silu'", lambda v: v == "silu")
    _expect("attention_bias", hf["attention_bias"], "False", lambda v: v is False)
    _expect("tie_word_embeddings", hf["tie_word_embeddings"], "False (this model has its own lm_head)",
            lambda v: v is False)
    rope = hf.get("rope_parameters") or {}
    rope_type = "rope_type" if "rope_type" in rope else "type"
    _expect(f"rope_parameters.{rope_type}", rope.get(rope_type, "default"), "'default' (no rope scaling)",
            lambda v: v == "default")
    layers, dense = hf["num_hidden_layers"], hf["first_k_dense_replace"]

    values: dict[str, Any] = {_RENAMED.get(k, k): hf[k] for k in (*_COPIED, *_RENAMED)}
    values.update(name=hf.get("_name_or_path") or "glm_moe_dsa", rope_interleaved=True,
                  indexer_rope_interleaved=True,
                  rope_theta=float(rope.get("rope_theta", hf["rope_theta"])),
                  indexer_types=indexer_types(hf, layers) if layers >= 1 else None)
    values.update(overrides)
    config = config_cls(**values)          # the fields' own ranges first, then how they agree
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is not None:
        expected = ["dense"] * min(dense, layers) + ["sparse"] * max(layers - dense, 0)
        _expect("mlp_layer_types", mlp_types, f"{expected} (first_k_dense_replace dense layers first)",
                lambda v: list(v) == expected)
    return config


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_str_list(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)


_INT = ("an int", _is_int)
#: The JSON type of every field this module reads (ranges are GLM5Config's to check), so that a
#: malformed value is named here instead of failing as a TypeError somewhere later. Only the
#: fields GlmMoeDsaConfig types as optional may be null.
_NULLABLE = ("rope_parameters", "mlp_layer_types", "indexer_types", "index_topk_pattern", "_name_or_path")
_FIELD_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **{k: _INT for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                         "num_hidden_layers", "num_attention_heads", "n_shared_experts", "n_routed_experts",
                         "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
                         "topk_group", "num_experts_per_tok", "index_topk", "index_head_dim", "index_n_heads",
                         "first_k_dense_replace", "index_topk_freq", "index_skip_topk_offset")},
    "routed_scaling_factor": ("a finite number", _is_number),
    "rms_norm_eps": ("a finite number > 0", lambda v: _is_number(v) and v > 0),
    "rope_theta": ("a finite number > 0", lambda v: _is_number(v) and v > 0),
    **{k: ("true or false", lambda v: isinstance(v, bool))
       for k in ("norm_topk_prob", "attention_bias", "tie_word_embeddings")},
    **{k: ("a string", lambda v: isinstance(v, str)) for k in ("model_type", "hidden_act", "_name_or_path")},
    "rope_parameters": ("an object (rope_type, rope_theta)", lambda v: isinstance(v, Mapping)),
    "rope_parameters.rope_type": ("a string", lambda v: isinstance(v, str)),
    "rope_parameters.type": ("a string", lambda v: isinstance(v, str)),
    "rope_parameters.rope_theta": ("a finite number > 0", lambda v: _is_number(v) and v > 0),
    "mlp_layer_types": ("a list of 'dense' / 'sparse'", _is_str_list),
    "indexer_types": ("a list of 'full' / 'shared'", _is_str_list),
    "index_topk_pattern": ("a string of 'F' and 'S', or a list of 'full' / 'shared'",
                           lambda v: isinstance(v, str) or _is_str_list(v)),
}


def _check_types(given: Mapping[str, Any]) -> None:
    def check(key: str, value) -> None:
        expected, ok = _FIELD_TYPES[key]
        if not (ok(value) or (value is None and key in _NULLABLE)):
            raise InvalidInputError(_OP, key, expected, repr(value)[:200])

    for key, value in given.items():
        if key in _FIELD_TYPES:
            check(key, value)
    pattern = given.get("index_topk_pattern")
    if isinstance(pattern, str):
        _expect("index_topk_pattern", pattern, "a string of 'F' and 'S'", lambda v: set(v) <= set("FS"))
    rope = given.get("rope_parameters") or {}
    for key in ("rope_type", "type", "rope_theta"):
        if key in rope:
            check(f"rope_parameters.{key}", rope[key])


def hf_field(name: str, hf: Mapping[str, Any] | None = None) -> str:
    """The config.json key of a GLM5Config field (GLM5Config's error names its own fields)."""
    if name == "rope_theta" and isinstance((hf or {}).get("rope_parameters"), Mapping) \
            and "rope_theta" in hf["rope_parameters"]:
        return "rope_parameters.rope_theta"
    return {ours: theirs for theirs, ours in _RENAMED.items()}.get(name, name)


def glm5_config_to_hf(config: Any) -> dict[str, Any]:
    """The HF `glm_moe_dsa` config.json fields of a GLM5Config (what `glm5_config_from_hf` reads
    back to an equal config, up to `name`). Raises InvalidInputError for what HF's config cannot
    say: split-half rope, or LoRA / indexer norm eps other than the 1e-6 HF's modeling code builds.
    The run-time switches (`attention`, `indexer_fp8`, `indexer_scale_fmt`) are not checkpoint
    facts and are not written."""
    op = "GLM5Config.to_hf_config"
    for field in ("rope_interleaved", "indexer_rope_interleaved"):
        _expect_in(op, field, getattr(config, field), "True (HF's glm_moe_dsa ropes interleaved pairs)",
                   lambda v: v is True)
    for field in ("lora_norm_eps", "indexer_norm_eps"):
        _expect_in(op, field, getattr(config, field), "1e-6 (fixed in HF's glm_moe_dsa modeling code)",
                   lambda v: v == 1e-6)
    renamed = {ours: hf for hf, ours in _RENAMED.items()}
    hf: dict[str, Any] = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}
    hf.update({renamed.get(k, k): getattr(config, k) for k in (*_COPIED, *renamed)})
    layers, dense = config.num_layers, config.first_dense_layers
    hf.update(hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
              indexer_types=list(config.indexer_types or ("full",) * layers),
              mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense))
    return hf


def indexer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """`indexer_types` as GlmMoeDsaConfig resolves it: the explicit list, else the
    `index_topk_pattern` string ("F"/"S" per layer), else the `index_topk_freq` /
    `index_skip_topk_offset` schedule (every layer full by default)."""
    if hf.get("indexer_types") is not None:
        return tuple(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            letters = {"F": "full", "S": "shared"}
            _expect("index_topk_pattern", pattern, "a string of 'F' and 'S'", lambda v: set(v) <= set(letters))
            return tuple(letters[c] for c in pattern)
        return tuple(pattern)
    freq = max(hf.get("index_topk_freq", 1), 1)
    offset = hf.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def _as_dict(source) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else os.fspath(source)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidInputError(_OP, "source", "a readable config.json", f"{path}: {e}") from None
        if not isinstance(data, dict):
            raise InvalidInputError(_OP, "source", "a JSON object", f"{path}: {type(data).__name__}")
        return data
    if callable(getattr(source, "to_dict", None)):
        return source.to_dict()
    raise InvalidInputError(_OP, "source", "a dict, a config.json path or folder, or a transformers config",
                            type(source).__name__)


def _expect(field: str, value, expected: str, ok) -> None:
    _expect_in(_OP, field, value, expected, ok)


def _expect_in(op: str, field: str, value, expected: str, ok) -> None:
    if not ok(value):
        raise InvalidInputError(op, field, expected, repr(value))
