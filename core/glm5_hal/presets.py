"""Model dimensions (GLM-5's configuration, docs/models.md) shared by the conformance cases,
the benchmarks and the small model: GLM-5's real per-layer shapes, with DeepSeek-V3.2's for comparison."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelDims:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    moe_intermediate_size: int
    intermediate_size: int
    first_dense_layers: int
    rope_theta: float
    rope_interleaved: bool
    indexer_rope_interleaved: bool
    vocab_size: int
    rms_norm_eps: float = 1e-5

    @property
    def d_qk(self) -> int:
        """Absorbed (MQA-mode) MLA query/key dim: latent + rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def d_v(self) -> int:
        return self.kv_lora_rank

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


GLM5 = ModelDims(
    name="glm5", hidden_size=6144, num_layers=78, num_heads=64, q_lora_rank=2048,
    kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    index_n_heads=32, index_head_dim=128, index_topk=2048, n_routed_experts=256,
    num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, moe_intermediate_size=2048, intermediate_size=12288,
    first_dense_layers=3, rope_theta=1e6, rope_interleaved=True,
    indexer_rope_interleaved=True, vocab_size=154880)

DEEPSEEK_V32 = ModelDims(
    name="deepseek_v32", hidden_size=7168, num_layers=61, num_heads=128, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    index_n_heads=64, index_head_dim=128, index_topk=2048, n_routed_experts=256,
    num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, moe_intermediate_size=2048, intermediate_size=18432,
    first_dense_layers=3, rope_theta=1e4, rope_interleaved=True,
    indexer_rope_interleaved=False, vocab_size=129280, rms_norm_eps=1e-6)

#: GLM-5's softmax scale: qk_head_dim ** -0.5 = 256 ** -0.5 (no YaRN mscale). Never
#: derive it from the absorbed head dim (FlashMLA's 576 ** -0.5 default is wrong here).
GLM5_SM_SCALE = GLM5.qk_head_dim ** -0.5
