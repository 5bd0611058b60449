"""The DSA lightning indexer of vLLM's GLM-5 / DeepSeek-V3.2 layers on glm5_hal ops.

`Glm5HalSparseAttnIndexer` replaces vLLM's `SparseAttnIndexer` custom op (registered
out-of-tree by class name). In layers whose attention glm5_hal serves it:

1. writes the step's keys into vLLM's indexer page with `indexer_k_cache_write` (FP8 rows,
   one ue8m0 float32 scale per row: the page's two block-strided views, written in place);
2. scores every query token against its request's cached keys with `indexer_topk_paged`
   (the FP8 pair read in place through the block table), one call per run of equal query
   lengths (paging.py), and writes the top-k logical positions into vLLM's shared buffer.

Everywhere else (another attention backend was chosen) it is vLLM's own indexer, unchanged.
Under vLLM's compilation the whole step is one opaque custom op
(`torch.ops.glm5_hal_vllm.sparse_attn_indexer`), as vLLM does with its own.
"""
from __future__ import annotations

import weakref

import torch

import glm5_hal as hal
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.utils.torch_utils import direct_register_custom_op

from . import ATTENTION_BACKEND
from .attention import Glm5HalIndexerBackend
from .paging import indexer_page_views
from .preflight import dispatch_scope

__all__ = ["Glm5HalSparseAttnIndexer", "Glm5HalIndexerCache", "serves_dsa"]

#: the live indexers of this process by layer name, for the custom op (holds no reference)
_LAYERS: "weakref.WeakValueDictionary[str, Glm5HalSparseAttnIndexer]" = weakref.WeakValueDictionary()
_LIBRARY = torch.library.Library("glm5_hal_vllm", "FRAGMENT")


def serves_dsa(vllm_config) -> bool:
    """glm5_hal serves this model's DSA: its platform is vLLM's, or the user chose its
    attention backend (`--attention-backend GLM5_HAL_SPARSE_MLA`)."""
    from vllm.platforms import current_platform
    from .platform import Glm5HalCpuPlatform
    if isinstance(current_platform, Glm5HalCpuPlatform):
        return True
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return backend is not None and getattr(backend, "name", str(backend)) == ATTENTION_BACKEND


class Glm5HalIndexerCache(DeepseekV32IndexerCache):
    """vLLM's indexer cache layer, bound to the glm5_hal indexer backend."""

    def get_attn_backend(self):
        return Glm5HalIndexerBackend


@SparseAttnIndexer.register_oot
class Glm5HalSparseAttnIndexer(SparseAttnIndexer):
    """vLLM's SparseAttnIndexer; on glm5_hal ops where glm5_hal serves the model's DSA."""

    def __init__(self, k_cache, quant_block_size: int, scale_fmt: str, topk_tokens: int,
                 head_dim: int, max_model_len: int, max_total_seq_len: int,
                 topk_indices_buffer: torch.Tensor, *args, **kwargs):
        super().__init__(k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                         max_total_seq_len, topk_indices_buffer, *args, **kwargs)
        self.glm5_hal = serves_dsa(get_current_vllm_config()) and not self.skip_k_cache_insert
        if not self.glm5_hal:
            return
        if self.use_fp4_cache or self.compress_ratio != 1 or quant_block_size != head_dim:
            raise ValueError(f"{ATTENTION_BACKEND}: this indexer (fp4 cache {self.use_fp4_cache}, compress ratio "
                             f"{self.compress_ratio}, quant block {quant_block_size} of head dim {head_dim}) is "
                             "not DeepSeek-V3.2 / GLM-5's: glm5_hal serves FP8 keys with one scale per key")
        if type(k_cache) is DeepseekV32IndexerCache:
            k_cache.__class__ = Glm5HalIndexerCache
        self.layer_name = k_cache.prefix
        _LAYERS[self.layer_name] = self

    def _hal_forward(self, hidden_states, q_quant, k, weights):
        if isinstance(q_quant, tuple):
            raise ValueError(f"{ATTENTION_BACKEND}: FP4 indexer queries are not served")
        torch.ops.glm5_hal_vllm.sparse_attn_indexer(q_quant, k, weights, self.layer_name,
                                                    self.topk_indices_buffer)
        return self.topk_indices_buffer

    def forward_native(self, hidden_states, q_quant, k, weights):
        if self.glm5_hal:
            return self._hal_forward(hidden_states, q_quant, k, weights)
        return super().forward_native(hidden_states, q_quant, k, weights)

    def forward_cpu(self, hidden_states, q_quant, k, weights):
        if self.glm5_hal:
            return self._hal_forward(hidden_states, q_quant, k, weights)
        return super().forward_cpu(hidden_states, q_quant, k, weights)

    def forward_cuda(self, hidden_states, q_quant, k, weights):
        if self.glm5_hal:
            return self._hal_forward(hidden_states, q_quant, k, weights)
        return super().forward_cuda(hidden_states, q_quant, k, weights)

    def step(self, q_fp8: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> None:
        """One step of this layer: keys into the cache, top-k into the shared buffer."""
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0]
        if isinstance(metadata, dict):
            metadata = metadata.get(self.layer_name)
        if metadata is None:   # the profiling run: no cache yet
            return
        with dispatch_scope()():
            self._step(metadata, q_fp8, k, weights)

    def _step(self, metadata, q_fp8: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> None:
        tokens = metadata.num_actual_tokens
        keys, scales = indexer_page_views(self.k_cache.kv_cache, self.head_dim)
        hal.ops.indexer_k_cache_write(k[:tokens], keys, scales, metadata.slot_mapping,
                                      "ue8m0" if self.scale_fmt is not None else None)
        # the FP8 codes as floats (exact): the per-row q scale is already folded into `weights`
        q = q_fp8[:tokens].to(torch.float32)
        buffer, topk = self.topk_indices_buffer, self.topk_tokens
        heads = q.shape[1]
        # vLLM's shared buffer is [max_num_batched_tokens, index_topk] int32 (vllm 0.32,
        # model_executor/models/deepseek_v2.py): a run's rows are one contiguous block, which
        # the op writes in place (out=); a wider buffer takes a copy of each run's result
        in_place = buffer.shape[1] == topk and buffer.dtype == torch.int32 and buffer.is_contiguous()
        for run in metadata.runs:
            reqs = slice(run.first, run.first + run.count)
            rows = slice(run.start, run.start + run.tokens)
            top = hal.ops.indexer_topk_paged(
                q[rows].reshape(run.count, run.length, heads, self.head_dim), (keys, scales),
                weights[rows].reshape(run.count, run.length, heads).float(),
                metadata.block_table[reqs], metadata.seq_lens[reqs], topk,
                out=buffer[rows].view(run.count, run.length, topk) if in_place else None)
            if not in_place:
                buffer[rows, :topk] = top.reshape(run.tokens, topk)


def _sparse_attn_indexer(q_fp8: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, layer_name: str,
                         topk_indices_buffer: torch.Tensor) -> None:
    _LAYERS[layer_name].step(q_fp8, k, weights)


def _sparse_attn_indexer_fake(q_fp8: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, layer_name: str,
                              topk_indices_buffer: torch.Tensor) -> None:
    return None


direct_register_custom_op("sparse_attn_indexer", _sparse_attn_indexer, mutates_args=["topk_indices_buffer"],
                          fake_impl=_sparse_attn_indexer_fake, target_lib=_LIBRARY)
