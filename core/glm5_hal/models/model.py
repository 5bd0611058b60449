"""The causal LM, its paged cache and greedy generation."""
from __future__ import annotations

import itertools
import math
import os
from typing import Hashable, Sequence

import torch
from torch import Tensor, nn

from ..errors import InvalidInputError
from ..kv import OutOfBlocksError, PagedKVCache
from . import checkpoint
from .config import GLM5Config
from .layers import DecoderLayer, Experts, LayerCache, RMSNorm, Router, Step

PREFILL_MODES = ("packed", "decode")


class GLM5Cache:
    """The paged caches of every layer over one `PagedKVCache` (one set of block tables
    and slot mappings serves the MLA latent caches and the indexer key caches of all layers).

    Sequences are created by `GLM5ForCausalLM.prefill`, extended by `decode`, shared by
    `fork` (prefix caching) and released by `free`.
    """

    def __init__(self, config: GLM5Config, num_blocks: int, block_size: int = 16, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.config = config
        self.paged = PagedKVCache(num_blocks, block_size, config.d_qk, dtype=dtype, device=device)
        layers = []
        for layer in range(config.num_layers):
            kv = self.paged.tensor if layer == 0 else self.paged.new_cache(config.d_qk)
            if config.attention == "dense" or config.shares_topk(layer):
                index_keys = None       # no indexer: dense attention, or the top-k is shared
            elif config.indexer_fp8:
                index_keys = (self.paged.new_cache(config.index_head_dim, dtype=torch.float8_e4m3fn),
                              self.paged.new_cache(dtype=torch.float32))
            else:
                index_keys = self.paged.new_cache(config.index_head_dim)
            layers.append(LayerCache(kv, index_keys))
        self.layers: list[LayerCache] = layers

    @property
    def block_size(self) -> int:
        return self.paged.block_size

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.paged

    def length(self, seq_id: Hashable) -> int:
        return int(self.paged.context_lens([seq_id])[0])

    def fork(self, parent: Hashable, child: Hashable) -> int:
        """Starts `child` on the full blocks of `parent` (shared, not copied); returns the
        number of tokens the child starts with. Prefill the child from that position."""
        return self.paged.fork(parent, child)

    def free(self, seq_id: Hashable) -> None:
        self.paged.free(seq_id)

    def blocks_needed(self, lengths: Sequence[int]) -> int:
        return sum(-(-n // self.block_size) for n in lengths)

    def step(self, seq_ids: Sequence[Hashable], counts: Sequence[int], *, packed: bool) -> Step:
        """Reserves `counts[b]` new slots for each sequence and describes them as a `Step`
        (with per-token key ranges when `packed`). Raises OutOfBlocksError, reserving
        nothing, when the pool is too small."""
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidInputError("GLM5Cache.step", "seq_ids", "distinct sequence ids", list(seq_ids))
        before = [self.length(s) if s in self.paged else 0 for s in seq_ids]
        # each sequence holds ceil(length / block_size) blocks (forks hold only full ones)
        needed = (self.blocks_needed([b + n for b, n in zip(before, counts)]) - self.blocks_needed(before))
        free = self.paged.allocator.num_free
        if needed > free:
            raise OutOfBlocksError(f"GLM5Cache.step: {sum(counts)} new tokens need {needed} more blocks "
                                   f"of {self.block_size}, only {free} free")
        device = self.paged.device
        slots = torch.cat([self.paged.append(s, n) for s, n in zip(seq_ids, counts)])
        positions = torch.cat([torch.arange(b, b + n, dtype=torch.int32, device=device)
                               for b, n in zip(before, counts)])
        block_table = self.paged.block_table(seq_ids)
        context_lens = self.paged.context_lens(seq_ids)
        if not packed:
            return Step(positions, slots, block_table, context_lens)
        # rows of sequence b start at the sum of the earlier context lengths once gathered
        offsets = torch.cumsum(context_lens, 0, dtype=torch.int32) - context_lens
        k_start = torch.repeat_interleave(offsets, torch.tensor(counts, device=device))
        return Step(positions, slots, block_table, context_lens, k_start, k_start + positions + 1)


class GLM5Model(nn.Module):
    """`model`: embeddings, decoder layers, final norm."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, step: Step, caches: Sequence[LayerCache]) -> Tensor:
        x = self.embed_tokens(input_ids)
        top = None                      # the last full layer's top-k, reused by "shared" layers
        for layer, cache in zip(self.layers, caches):
            x, top = layer(x, step, cache, top)
        return self.norm(x)


class GLM5ForCausalLM(nn.Module):
    """A GLM-5-architecture causal LM (HF `GlmMoeDsaForCausalLM` parameter names) whose every
    attention, MoE, norm, rope and cache computation is a `glm5_hal.ops` call.

        model = GLM5ForCausalLM(GLM5Config.tiny(), seed=0)
        tokens = model.generate([1, 2, 3], max_new_tokens=8)

    Inference only (the methods run under torch.no_grad). Without a seed the weights are
    uninitialised: load them with `load_state_dict`, or build the model from a checkpoint
    directory with `from_pretrained`.
    """

    def __init__(self, config: GLM5Config, *, seed: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        self.model = GLM5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._seq_counter = itertools.count()
        #: what from_pretrained loaded (checkpoint.CheckpointInfo); None for a model built from a config
        self.checkpoint_info: checkpoint.CheckpointInfo | None = None
        if seed is not None:
            self.init_weights(seed)
        self.to(device=device, dtype=dtype)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                        quantize: str | None = None, *, device: torch.device | str | None = None,
                        **config_overrides) -> "GLM5ForCausalLM":
        """The model of an HF-layout checkpoint directory: config.json (HF `glm_moe_dsa` field
        names, `indexer_types`, `quantization_config`) and model.safetensors, or the shards listed
        by model.safetensors.index.json. Weights are float (BF16, ...) or FP8 in the DeepSeek-V3 /
        GLM-5-FP8 format (`weight` float8_e4m3fn + `weight_scale_inv`, one float32 scale per 128 x
        128 block): FP8 linear layers stay FP8 and run `fp8_block_quant` + `fp8_block_gemm` /
        `fp8_grouped_gemm`.

        dtype: of the float weights and the activations (None: config.json's `dtype`).
        quantize: None, or "int8" to convert the linear layers and experts to W8A8 at load
            (per-output-channel weight scales; `int8_quant` + `int8_gemm` / `int8_grouped_gemm`).
        device: where the weights go (default cpu).
        config_overrides: run-time GLM5Config switches, e.g. attention="dense", indexer_fp8=True.

        The files are memory-mapped and read tensor by tensor into the allocated model: the
        process never holds a second copy of the weights. The MTP layers
        (`model.layers.<num_hidden_layers>.*`) are skipped with a SkippedTensorsWarning. A tensor
        that is unknown, missing, or of the wrong shape, dtype or format raises CheckpointError
        naming the tensor and its file, before any weight is read; an unsupported
        quantization_config raises InvalidInputError naming the field. What was loaded is in
        `model.checkpoint_info`.
        """
        return checkpoint.load_pretrained(cls, path, dtype, quantize, device, config_overrides)

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> list[str]:
        """Writes the model as an HF-layout checkpoint `from_pretrained` (and transformers)
        reads: config.json (HF field names; a loaded checkpoint's other fields kept),
        model.safetensors, or shards of at most `max_shard_size` bytes (an int or "5GB",
        "500MiB", ...; a larger tensor gets a shard of its own) with
        model.safetensors.index.json. FP8 layers are written as `weight` + `weight_scale_inv`
        with the quantization_config. An INT8 model (quantize="int8") cannot be saved. Weight
        files of an earlier save in `path` are removed. Returns the files written."""
        return checkpoint.save_pretrained(self, path, max_shard_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic random weights: projections ~ N(0, 1/fan_in) so activations keep
        unit scale through the layers (attention and routing are then far from uniform,
        which the tests need to tell DSA from dense attention), embeddings ~ N(0, 1), norm
        weights 1 + N(0, 0.1^2), biases (LayerNorm, router correction) ~ N(0, 0.1^2)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                value = noise
            elif p.ndim == 1:
                value = 0.1 * noise + (1.0 if name.endswith("norm.weight") else 0.0)
            else:
                value = noise / math.sqrt(p.shape[-1])
            p.copy_(value)
        for module in self.modules():
            if isinstance(module, Router):
                bias = module.e_score_correction_bias
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))

    def new_cache(self, num_blocks: int, block_size: int = 16) -> GLM5Cache:
        """An empty paged cache of `num_blocks` blocks of `block_size` tokens for this model."""
        return GLM5Cache(self.config, num_blocks, block_size, dtype=self.dtype, device=self.device)

    def forward(self, input_ids: Tensor, step: Step, caches: Sequence[LayerCache]) -> Tensor:
        """Logits float32 [T, vocab] of the packed new tokens `input_ids` [T] (int64),
        writing their cache rows. `step` says where they go (`GLM5Cache.step`)."""
        return self.lm_head(self.model(input_ids, step, caches)).float()

    def decode_step(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
                    block_table: Tensor, context_lens: Tensor, caches: Sequence[LayerCache]) -> Tensor:
        """One decode step of B sequences as a function of tensors only (what
        torch.compile(fullgraph=True) captures): input_ids int64 [B] -> logits [B, vocab]."""
        return self(input_ids, Step(positions, slot_mapping, block_table, context_lens), caches)

    @torch.no_grad()
    def prefill(self, cache: GLM5Cache, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]], *,
                mode: str = "packed") -> Tensor:
        """Appends token_ids[b] (>= 1 token each) to sequence seq_ids[b], created if new or
        continuing from its cached tokens (e.g. after `cache.fork`). Returns the logits
        float32 [sum of lengths, vocab] of every new token, packed in batch order.

        mode "packed" runs each layer once over all tokens (indexer_topk and
        sparse_mla_attention over the gathered context); "decode" feeds the tokens one
        position at a time through the decode path.
        """
        _choice("GLM5ForCausalLM.prefill", "mode", mode, PREFILL_MODES)
        lists = self._token_lists("GLM5ForCausalLM.prefill", "token_ids", token_ids, seq_ids)
        if mode == "packed":
            step = cache.step(seq_ids, [len(t) for t in lists], packed=True)
            ids = torch.tensor([t for ts in lists for t in ts], dtype=torch.long, device=self.device)
            return self(ids, step, cache.layers)
        per_position = []
        for i in range(max(len(t) for t in lists)):
            active = [b for b, t in enumerate(lists) if i < len(t)]
            logits = self._decode(cache, [seq_ids[b] for b in active],
                                  torch.tensor([lists[b][i] for b in active], device=self.device))
            per_position.append(dict(zip(active, logits)))
        return torch.stack([per_position[i][b] for b, t in enumerate(lists) for i in range(len(t))])

    @torch.no_grad()
    def decode(self, cache: GLM5Cache, seq_ids: Sequence[Hashable], token_ids: Sequence[int] | Tensor) -> Tensor:
        """Appends one token to each existing sequence; returns their logits float32 [B, vocab]."""
        for s in seq_ids:
            if s not in cache:
                raise InvalidInputError("GLM5ForCausalLM.decode", "seq_ids",
                                        "sequences of this cache (prefill them first)", repr(s))
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.shape[0] != len(seq_ids):
            raise InvalidInputError("GLM5ForCausalLM.decode", "token_ids", f"{len(seq_ids)} tokens "
                                    "(one per sequence)", f"{ids.shape[0]}")
        self._check_vocab("GLM5ForCausalLM.decode", "token_ids", ids.tolist())
        return self._decode(cache, seq_ids, ids)

    def _decode(self, cache: GLM5Cache, seq_ids: Sequence[Hashable], ids: Tensor) -> Tensor:
        step = cache.step(seq_ids, [1] * len(seq_ids), packed=False)
        return self.decode_step(ids, step.positions, step.slot_mapping, step.block_table, step.context_lens,
                                cache.layers)

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int, *,
                 cache: GLM5Cache | None = None, block_size: int = 16,
                 prefill: str = "packed") -> list[int] | list[list[int]]:
        """Greedy generation. `prompt_ids` is one prompt (a list of ints) or a batch of them,
        decoded together; returns the `max_new_tokens` new tokens of each (same nesting).
        Uses `cache` if given (its sequences are freed afterwards), else a fresh one just
        large enough."""
        if isinstance(prompt_ids, Tensor):
            prompt_ids = prompt_ids.tolist()
        batched = bool(prompt_ids) and not isinstance(prompt_ids[0], int)
        prompts = [list(p) for p in prompt_ids] if batched else [list(prompt_ids)]
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError("GLM5ForCausalLM.generate", "max_new_tokens", "an int >= 0",
                                    repr(max_new_tokens))
        seq_ids = [("generate", next(self._seq_counter)) for _ in prompts]
        self._token_lists("GLM5ForCausalLM.generate", "prompt_ids", prompts, seq_ids)
        if cache is None:
            lengths = [len(p) + max_new_tokens for p in prompts]
            cache = GLM5Cache(self.config, -(-max(lengths) // block_size) * len(prompts), block_size,
                              dtype=self.dtype, device=self.device)
        out: list[list[int]] = [[] for _ in prompts]
        try:
            if max_new_tokens:
                logits = self.prefill(cache, seq_ids, prompts, mode=prefill)
                last = torch.tensor([len(p) for p in prompts], device=logits.device).cumsum(0) - 1
                tokens = logits[last].argmax(-1)
                for _ in range(max_new_tokens - 1):
                    for o, t in zip(out, tokens.tolist()):
                        o.append(t)
                    tokens = self.decode(cache, seq_ids, tokens).argmax(-1)
                for o, t in zip(out, tokens.tolist()):
                    o.append(t)
        finally:
            for s in seq_ids:
                if s in cache:
                    cache.free(s)
        return out if batched else out[0]

    def _token_lists(self, op: str, arg: str, token_ids, seq_ids) -> list[list[int]]:
        lists = [list(t) for t in token_ids]
        if len(lists) != len(seq_ids):
            raise InvalidInputError(op, arg, f"{len(seq_ids)} token lists (one per sequence)", len(lists))
        for b, t in enumerate(lists):
            if not t:
                raise InvalidInputError(op, arg, "at least one token per sequence", f"none for sequence {b}")
            self._check_vocab(op, arg, t)
        return lists

    def _check_vocab(self, op: str, arg: str, tokens: list) -> None:
        v = self.config.vocab_size
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < v]
        if bad:
            raise InvalidInputError(op, arg, f"token ids in [0, {v})", repr(bad[0]))


def _choice(op: str, arg: str, value, choices) -> None:
    if value not in choices:
        raise InvalidInputError(op, arg, f"one of {choices}", repr(value))


__all__ = ["GLM5Cache", "GLM5Model", "GLM5ForCausalLM", "Experts", "PREFILL_MODES"]
