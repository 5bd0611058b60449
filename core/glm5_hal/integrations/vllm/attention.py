"""vLLM attention backends on glm5_hal ops: sparse MLA (`GLM5_HAL_SPARSE_MLA`) for GLM-5 /
DeepSeek-V3.2 DSA layers, and the indexer's K-cache backend (`GLM5_HAL_DSA_INDEXER`).

The MLA cache is vLLM's `[num_blocks, block_size, 576]` page (512 latent + 64 rope) in the
model dtype; the indexer cache is vLLM's uint8 page per block: `block_size x 128` FP8 keys then
`block_size` float32 scales. Both are read and written in place by glm5_hal's paged ops
(`kv_cache_write`, `indexer_k_cache_write`, `indexer_topk_paged`, `sparse_mla_decode_paged`),
which take block-strided views: no step copies or re-lays out a cache.

Every token of a step goes through the sparse (absorbed, MQA) path, prefill included: the
indexer's top-k of each token selects at most `index_topk` positions of its own request's
context (logical positions, as vLLM's shared top-k buffer holds them), and
`sparse_mla_decode_paged` attends to them through the block table.
"""
from __future__ import annotations

from typing import ClassVar

import torch

import glm5_hal as hal
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadata,
                                       AttentionMetadataBuilder, MLAAttentionImpl)
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer

from . import ATTENTION_BACKEND
from .paging import StepBatch, build_step_batch
from .preflight import DsaShapes, check_served, dispatch_scope

__all__ = ["Glm5HalDsaMetadata", "Glm5HalDsaMetadataBuilder", "Glm5HalSparseMLABackend",
           "Glm5HalSparseMLAImpl", "Glm5HalIndexerBackend", "INDEXER_BACKEND"]

INDEXER_BACKEND = "GLM5_HAL_DSA_INDEXER"
#: the model dtypes the hal ops take (vLLM's default list lacks float32)
MODEL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


class Glm5HalDsaMetadata(StepBatch, AttentionMetadata):
    """One step's batch for the glm5_hal DSA ops (glm5_hal.integrations.vllm.paging)."""


class Glm5HalDsaMetadataBuilder(AttentionMetadataBuilder[Glm5HalDsaMetadata]):
    """Builds the step's Glm5HalDsaMetadata from vLLM's common metadata: views of vLLM's
    per-step buffers and the runs of equal query lengths (host data only)."""
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # decodes first: they form one batched run
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)   # the base's is abstract

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False
              ) -> Glm5HalDsaMetadata:
        return build_step_batch(common_attn_metadata, Glm5HalDsaMetadata)


class Glm5HalSparseMLABackend(AttentionBackend):
    """Sparse MLA on glm5_hal ops, for any model dtype the hal ops take and any block size."""
    supported_dtypes: ClassVar[list[torch.dtype]] = MODEL_DTYPES
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", "float32"]

    @staticmethod
    def get_name() -> str:
        return ATTENTION_BACKEND

    @staticmethod
    def get_impl_cls() -> type["Glm5HalSparseMLAImpl"]:
        return Glm5HalSparseMLAImpl

    @staticmethod
    def get_builder_cls() -> type[Glm5HalDsaMetadataBuilder]:
        return Glm5HalDsaMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True


class Glm5HalIndexerBackend(AttentionBackend):
    """The indexer K cache's backend: the same per-step batch as the attention. vLLM 0.32 binds
    DeepSeek-V3.2 indexer caches to DeepseekV32IndexerBackend, whose metadata builder runs
    Triton kernels (no CPU backend) and whose kernels take block size 64 only; caches of the
    layers glm5_hal serves are bound to this one instead (indexer.py)."""
    supported_dtypes: ClassVar[list[torch.dtype]] = MODEL_DTYPES

    @staticmethod
    def get_name() -> str:
        return INDEXER_BACKEND

    @staticmethod
    def get_impl_cls():
        raise TypeError(f"{INDEXER_BACKEND} holds the DSA indexer's keys; the indexer layer "
                        "(glm5_hal.integrations.vllm.indexer) computes with it, no attention impl does")

    @staticmethod
    def get_builder_cls() -> type[Glm5HalDsaMetadataBuilder]:
        return Glm5HalDsaMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 128, 132]


class Glm5HalSparseMLAImpl(MLAAttentionImpl[Glm5HalDsaMetadata], SharedTopkIndicesBuffer):
    """forward_mqa: `sparse_mla_decode_paged` over the step's runs; do_kv_cache_update:
    `kv_cache_write` of cat(latent, rope) rows into vLLM's page."""
    is_sparse = True
    supports_dense_mha_prefill = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap,
                 attn_type: str, kv_sharing_target_layer_name, topk_indices_buffer=None,
                 indexer=None, **mla_args) -> None:
        for name, value, why in (("alibi_slopes", alibi_slopes, "ALiBi"),
                                 ("sliding_window", sliding_window, "a sliding window"),
                                 ("logits_soft_cap", logits_soft_cap, "a logits soft cap")):
            if value is not None:
                raise ValueError(f"{ATTENTION_BACKEND}: sparse MLA has no {why} ({name}={value!r})")
        if kv_cache_dtype not in Glm5HalSparseMLABackend.supported_kv_cache_dtypes:
            raise ValueError(f"{ATTENTION_BACKEND}: kv_cache_dtype {kv_cache_dtype!r} is not served: the "
                             "MLA cache is kept in the model dtype (use --kv-cache-dtype auto)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.dcp_world_size = 1
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)
        if indexer is not None:
            from vllm.config import get_current_vllm_config
            config = get_current_vllm_config()
            shapes = DsaShapes(heads=num_heads, kv_lora_rank=self.kv_lora_rank,
                               rope_dim=mla_args["qk_rope_head_dim"], index_heads=indexer.n_head,
                               index_dim=indexer.head_dim, index_topk=indexer.topk_tokens)
            check_served(config.model_config.dtype, torch.device(config.device_config.device), shapes)
        self.scope = dispatch_scope()

    def record_logical_topk_ready(self) -> None:
        """vLLM's MLA layer calls this after the indexer wrote the top-k buffer; the buffer holds
        logical positions, which is what sparse_mla_decode_paged takes: nothing to convert."""

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return
        tokens = min(kv_c_normed.shape[0], slot_mapping.shape[0])
        rows = torch.cat((kv_c_normed[:tokens], k_pe[:tokens].reshape(tokens, -1)), dim=-1)
        with self.scope():
            hal.ops.kv_cache_write(kv_cache, rows, slot_mapping.reshape(-1)[:tokens])

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Glm5HalDsaMetadata,
                    layer) -> tuple[torch.Tensor, None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        topk = self.topk_indices_buffer
        if topk is None:
            raise RuntimeError(f"{ATTENTION_BACKEND}: a sparse MLA layer without an indexer top-k buffer")
        tokens, heads = attn_metadata.num_actual_tokens, q.shape[1]
        out = q.new_empty((tokens, heads, self.kv_lora_rank))
        with self.scope():
            self._attend(q, kv_c_and_k_pe_cache, attn_metadata, topk, out)
        return out, None

    def _attend(self, q, kv_cache, attn_metadata, topk, out) -> None:
        heads = q.shape[1]
        for run in attn_metadata.runs:
            reqs = slice(run.first, run.first + run.count)
            rows = slice(run.start, run.start + run.tokens)
            # each run writes straight into its rows of the step's output (contiguous: a slice
            # of whole rows), no per-run result to copy
            hal.ops.sparse_mla_decode_paged(
                q[rows].reshape(run.count, run.length, heads, q.shape[-1]), kv_cache,
                attn_metadata.block_table[reqs], attn_metadata.seq_lens[reqs],
                topk[rows].reshape(run.count, run.length, topk.shape[-1]), self.scale, self.kv_lora_rank,
                out=out[rows].view(run.count, run.length, heads, self.kv_lora_rank))
