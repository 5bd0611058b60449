"""vLLM's CPU platform with GLM-5 / DeepSeek-V3.2 sparse attention on glm5_hal.

Everything is vLLM 0.32's `CpuPlatform` (`_enum` stays CPU: vLLM's CPU worker, MoE router and
custom-op dispatch key on it) except for models with DeepSeek Sparse Attention (an MLA model
whose config has `index_topk`):

- the attention backend is glm5_hal's sparse MLA (vLLM's raises "Sparse Attention is not
  supported on CPU");
- prefix caching and chunked prefill stay as the user (or vLLM's defaults) set them: vLLM
  turns both off for MLA on CPUs without AMX because its own CPU MLA kernels cannot serve
  them; the glm5_hal ops read any context through the block table;
- the KV block size is 64 (vLLM's DSA indexer default) unless the user chose one: the
  glm5_hal paged ops take any block size, vLLM's CPU MLA kernel would force 16;
- a GLM-5 checkpoint saved by HF transformers gets what transformers' GLM-MoE-DSA modeling does
  implicitly and its `GlmMoeDsaConfig` does not say, where vLLM would otherwise guess wrong:
  sigmoid routing with the `noaux_tc` correction bias (vLLM's default is softmax, and it would
  not load `e_score_correction_bias`), and interleaved RoPE in the indexer (vLLM reads
  `indexer_rope_interleave`, default False: NeoX).

- RoPE runs as vLLM's `forward_native` (`-rotary_embedding` in compilation_config.custom_ops,
  unless the user named the op): vLLM 0.32's CPU rotary kernel (`vllm._C` rotary_embedding)
  rotates a multi-head query passed as `[T, H, rotary_dim]` wrongly in the GPT-J (interleaved)
  style that DeepSeek MLA and the GLM-5 indexer use (a 2-D `[T, H * rotary_dim]` query is
  right); vLLM's MLA layer passes the 3-D view. `forward_native` is what vLLM itself runs
  under its default compilation on the CPU. tests/test_integrations_vllm.py pins the kernel's
  behaviour, so the day it is fixed this says so.

Every other model is configured exactly as vLLM's CPU platform configures it.
"""
from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

__all__ = ["Glm5HalCpuPlatform", "is_dsa_model", "DSA_BLOCK_SIZE"]

#: vLLM's custom op of every RotaryEmbedding class (model_executor/layers/rotary_embedding/base.py)
ROPE_OP = "rotary_embedding"
#: the KV block size of DSA models unless the user chose one (vLLM's DSA indexer's kernel size)
DSA_BLOCK_SIZE = 64
#: what transformers' GLM-MoE-DSA modeling (modeling_glm_moe_dsa.py: GlmMoeDsaTopkRouter's sigmoid
#: with e_score_correction_bias, GlmMoeDsaIndexer's apply_rotary_pos_emb_interleave) does without
#: a config key, under the keys vLLM 0.32 reads (deepseek_v2.py)
GLM5_IMPLICIT = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "indexer_rope_interleave": True}


def is_dsa_model(model_config) -> bool:
    if model_config is None or not getattr(model_config, "use_mla", False):
        return False
    return getattr(model_config.hf_text_config, "index_topk", None) is not None


class Glm5HalCpuPlatform(CpuPlatform):
    """vLLM's CPU platform; DSA models' attention and indexer on glm5_hal ops."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_sparse:
            from . import ATTENTION_BACKEND
            if not attn_selector_config.use_mla:
                raise ValueError(f"{ATTENTION_BACKEND} serves sparse MLA (DeepSeek Sparse Attention); "
                                 "this model asks for sparse attention without MLA")
            return "glm5_hal.integrations.vllm.attention.Glm5HalSparseMLABackend"
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if not is_dsa_model(model_config):
            super().check_and_update_config(vllm_config)
            return
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        chosen = (cache.enable_prefix_caching, scheduler.enable_chunked_prefill,
                  scheduler.max_num_batched_tokens)
        user_block_size = cache.block_size if cache.user_specified_block_size else None
        super().check_and_update_config(vllm_config)
        (cache.enable_prefix_caching, scheduler.enable_chunked_prefill,
         scheduler.max_num_batched_tokens) = chosen
        cache.block_size = user_block_size or DSA_BLOCK_SIZE
        custom_ops = vllm_config.compilation_config.custom_ops
        if not {f"+{ROPE_OP}", f"-{ROPE_OP}"} & set(custom_ops):
            custom_ops.append(f"-{ROPE_OP}")
        hf_config = model_config.hf_text_config
        if getattr(hf_config, "model_type", None) == "glm_moe_dsa":
            for key, value in GLM5_IMPLICIT.items():
                if getattr(hf_config, key, None) is None:
                    setattr(hf_config, key, value)
