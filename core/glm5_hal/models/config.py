"""The model configuration: GLM-5's dimensions (`glm5_hal.presets.GLM5`) or a tiny CPU-sized
variant with the same structure."""
from __future__ import annotations

import dataclasses
import math

from .. import presets
from ..errors import InvalidInputError
from .hf_config import glm5_config_from_hf, glm5_config_to_hf

ATTENTION_MODES = ("sparse", "dense")
INDEXER_TYPES = ("full", "shared")


@dataclasses.dataclass(frozen=True)
class GLM5Config(presets.ModelDims):
    """The dimensions (`presets.ModelDims`) and switches of a GLM-5-architecture model (HF
    `glm_moe_dsa` field names where HF has one: `num_layers` is `num_hidden_layers`, `first_dense_layers` is
    `first_k_dense_replace`).

    attention: "sparse" runs DSA (indexer top-k, then sparse MLA), "dense" skips the
        indexer and attends every previous token (the baseline DSA must equal when
        index_topk >= context length).
    lora_norm_eps: eps of q_a_layernorm and kv_a_layernorm (HF builds them with the RMSNorm
        default 1e-6, not rms_norm_eps); indexer_norm_eps: eps of the indexer's key LayerNorm.
    indexer_fp8: the indexer keeps FP8 keys (one scale per row, `indexer_k_cache_write`) and
        FP8-quantizes its queries with the scale folded into the head weights, as
        DeepSeek-V3.2's inference code does.
    indexer_types: per layer "full" (the layer runs its indexer) or "shared" (it has no
        indexer and reuses the top-k of the previous full layer: GLM-5.x cross-layer top-k
        sharing, arXiv 2603.12201, HF `indexer_types`); None: every layer "full". The first
        layer must be "full".
    """
    norm_topk_prob: bool = True
    lora_norm_eps: float = 1e-6
    indexer_norm_eps: float = 1e-6
    attention: str = "sparse"
    indexer_fp8: bool = False
    indexer_scale_fmt: str | None = None
    indexer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "q_lora_rank",
                      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                      "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size",
                      "intermediate_size"):
            _require(field, getattr(self, field), "an int >= 1", _is_int(getattr(self, field), 1))
        _require("n_shared_experts", self.n_shared_experts, "an int >= 0", _is_int(self.n_shared_experts, 0))
        _require("first_dense_layers", self.first_dense_layers, f"an int in [0, num_layers={self.num_layers}]",
                 _is_int(self.first_dense_layers, 0) and self.first_dense_layers <= self.num_layers)
        _require("qk_rope_head_dim", self.qk_rope_head_dim, "an even int (rope rotates pairs)",
                 self.qk_rope_head_dim % 2 == 0)
        # the Hadamard rotation of the indexer needs a power of two
        _require("index_head_dim", self.index_head_dim, "a power of two",
                 self.index_head_dim & (self.index_head_dim - 1) == 0)
        _require("index_head_dim", self.index_head_dim,
                 f">= qk_rope_head_dim={self.qk_rope_head_dim} (the indexer ropes its first "
                 "qk_rope_head_dim dims)", self.index_head_dim >= self.qk_rope_head_dim)
        _require("n_group", self.n_group, f"a divisor of n_routed_experts={self.n_routed_experts}",
                 self.n_routed_experts % self.n_group == 0)
        _require("topk_group", self.topk_group, f"an int in [1, n_group={self.n_group}]",
                 self.topk_group <= self.n_group)
        _require("num_experts_per_tok", self.num_experts_per_tok,
                 f"<= topk_group * experts per group = {self.topk_group * self.n_routed_experts // self.n_group}",
                 self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group)
        _require("rope_theta", self.rope_theta, "a finite number > 0",
                 isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta)
                 and self.rope_theta > 0)
        _require("attention", self.attention, f"one of {ATTENTION_MODES}", self.attention in ATTENTION_MODES)
        _require("indexer_scale_fmt", self.indexer_scale_fmt, "None or 'ue8m0'",
                 self.indexer_scale_fmt in (None, "ue8m0"))
        if self.indexer_types is not None:
            types = self.indexer_types
            _require("indexer_types", types, f"a sequence of {self.num_layers} of {INDEXER_TYPES} "
                     "(one per layer)", isinstance(types, (list, tuple)) and len(types) == self.num_layers
                     and all(t in INDEXER_TYPES for t in types))
            _require("indexer_types", types, "'full' for layer 0 (a shared layer reuses the top-k of "
                     "the previous full layer)", types[0] == "full")
            object.__setattr__(self, "indexer_types", tuple(types))   # hashable, like the rest

    @property
    def sm_scale(self) -> float:
        """qk_head_dim ** -0.5 (GLM-5: 256 ** -0.5): the scale of the *unabsorbed* head,
        which absorption leaves unchanged. Never d_qk ** -0.5."""
        return self.qk_head_dim ** -0.5

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers

    def shares_topk(self, layer: int) -> bool:
        """The layer has no indexer and reuses the previous full layer's top-k."""
        return self.indexer_types is not None and self.indexer_types[layer] == "shared"

    def replace(self, **changes) -> "GLM5Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dims(cls, dims: presets.ModelDims, **overrides) -> "GLM5Config":
        """A config with the dimensions of a `presets.ModelDims` (e.g. `presets.GLM5`)."""
        values = dataclasses.asdict(dims)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_hf_config(cls, source, **overrides) -> "GLM5Config":
        """The config of an HF `glm_moe_dsa` checkpoint: its config.json (a path, its folder,
        its parsed dict) or a transformers config object, read without transformers
        (`glm5_hal.models.hf_config`: HF's defaults, `indexer_types`, what is rejected)."""
        return glm5_config_from_hf(cls, source, **overrides)

    def to_hf_config(self) -> dict:
        """The HF `glm_moe_dsa` config.json fields of this config (`from_hf_config` reads them
        back); InvalidInputError for what HF's config cannot say (`hf_config.glm5_config_to_hf`)."""
        return glm5_config_to_hf(self)

    @classmethod
    def glm5(cls, **overrides) -> "GLM5Config":
        """GLM-5's real dimensions (78 layers, 256 experts: far too big to instantiate on a
        CPU; use `num_layers=` and friends to scale it down)."""
        return cls.from_dims(presets.GLM5, **overrides)

    @classmethod
    def tiny(cls, **overrides) -> "GLM5Config":
        """GLM-5's structure at CPU size: 3 layers (1 dense + 2 MoE), 4 heads, 8 experts
        top-2 + 1 shared, an indexer of 16 heads x 32 keeping the top 8 tokens.

        Why 16 indexer heads: a key's indexer logit is exactly 0 when every head's dot
        product is negative (relu), which happens with probability 2^-heads. Keys tied at
        the top-k boundary are kept in an implementation-defined order, so with 4 heads
        (1 key in 16 at 0) two correct backends would often pick different tokens; with
        GLM-5's 32 heads it practically never happens, with 16 rarely."""
        values = dict(
            name="tiny", vocab_size=512, hidden_size=256, num_layers=3, num_heads=4, q_lora_rank=64,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            index_n_heads=16, index_head_dim=32, index_topk=8, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            routed_scaling_factor=2.5, moe_intermediate_size=64, intermediate_size=256,
            first_dense_layers=1, rope_theta=1e6, rope_interleaved=True,
            indexer_rope_interleaved=True)
        values.update(overrides)
        return cls(**values)


def _is_int(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _require(field: str, value, expected: str, ok: bool) -> None:
    if not ok:
        raise InvalidInputError("GLM5Config", field, expected, repr(value))
