"""`glm5-hal demo`: a GLM-5-architecture model generating through the HAL -- the tiny one with
seeded weights, or a checkpoint directory's (`--checkpoint`) -- with the implementation
dispatch chose for every op it calls and any fallbacks to the reference."""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from typing import Any, Sequence, TextIO

import torch

from .. import registry
from ..errors import InvalidInputError
from .checkpoint import SkippedTensorsWarning
from .config import GLM5Config
from .model import GLM5ForCausalLM
from .trace import OpCalls, record_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def describe(config: GLM5Config) -> str:
    c = config
    dense = c.first_dense_layers
    index = ("dense attention (no indexer)" if c.attention == "dense" else
             f"DSA indexer {c.index_n_heads} x {c.index_head_dim} top-{c.index_topk}"
             + (" (FP8 keys)" if c.indexer_fp8 else ""))
    return (f"{c.num_layers} layers ({dense} dense, {c.num_layers - dense} MoE), hidden {c.hidden_size}, "
            f"{c.num_heads} heads, MLA latent {c.kv_lora_rank} + rope {c.qk_rope_head_dim}, {index}, "
            f"{c.n_routed_experts} experts top-{c.num_experts_per_tok} + {c.n_shared_experts} shared, "
            f"vocab {c.vocab_size}")


def run(tokens: int = 32, backend: str | None = None, seed: int = 0, prompt_len: int = 16,
        dtype: str | None = None, fp8_indexer: bool = False, device: str = "cpu",
        out: TextIO | None = None, checkpoint: str | os.PathLike | None = None, quantize: str | None = None,
        prompt_ids: Sequence[int] | None = None, prompt: str | None = None) -> dict:
    """Builds the model -- the tiny one with weights from `seed`, or the checkpoint directory's
    (`GLM5ForCausalLM.from_pretrained(checkpoint, dtype, quantize)`) -- generates `tokens`
    tokens greedily after the prompt (`prompt_ids`; `prompt` text, encoded by the checkpoint's
    tokenizer.json; else `prompt_len` random token ids from `seed`), and reports speed, the
    implementation serving each op (hal.explain of the op's first call in a prefill and in a
    decode step) and the fallbacks counted while the demo ran. `dtype`: float32 for the tiny
    model, the checkpoint's by default. Returns the same facts as a dict."""
    out = out or sys.stdout
    if checkpoint is None:
        if quantize is not None or prompt is not None:
            raise InvalidInputError("glm5-hal demo", "--quantize" if quantize is not None else "--prompt",
                                    "--checkpoint (it applies to a checkpoint's weights or tokenizer)", "no checkpoint")
        config = GLM5Config.tiny(indexer_fp8=fp8_indexer)
        model = GLM5ForCausalLM(config, seed=seed, dtype=DTYPES[dtype or "float32"], device=device)
        source = f"random, seed {seed}"
    else:
        overrides = {"indexer_fp8": True} if fp8_indexer else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SkippedTensorsWarning)
            model = GLM5ForCausalLM.from_pretrained(checkpoint, DTYPES[dtype] if dtype else None, quantize,
                                                    device=device, **overrides)
        for w in caught:
            if not issubclass(w.category, SkippedTensorsWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        config = model.config
        source = _describe_checkpoint(model.checkpoint_info)
    tokenizer = _tokenizer(checkpoint) if checkpoint is not None else None
    if prompt is not None:
        if tokenizer is None:
            raise InvalidInputError("glm5-hal demo", "--prompt", f"a tokenizer.json in {checkpoint} and the "
                                    "`tokenizers` package (or pass --prompt-ids)", "no tokenizer")
        prompt_ids = tokenizer.encode(prompt).ids
    if prompt_ids is None:
        prompt_ids = torch.randint(0, config.vocab_size, (prompt_len,),
                                   generator=torch.Generator().manual_seed(seed)).tolist()
    prompt = list(prompt_ids)
    pin = registry.use(backend) if backend else contextlib.nullcontext()
    fallbacks_before = registry.fallback_stats()
    with pin, warnings.catch_warnings():
        # fallbacks are summarised below from hal.fallback_stats(), not warned one by one
        warnings.simplefilter("ignore", registry.FallbackWarning)
        start = time.perf_counter()
        generated = model.generate(prompt, tokens)
        elapsed = time.perf_counter() - start
        prefill_calls, decode_calls = _trace_one_step(model, prompt)
        chosen = {}
        for name in sorted(set(prefill_calls.counts) | set(decode_calls.counts)):
            args = decode_calls.first_args.get(name) or prefill_calls.first_args[name]
            chosen[name] = registry.explain(name, *args)
    fallbacks = {k: v - fallbacks_before.get(k, 0) for k, v in registry.fallback_stats().items()
                 if v > fallbacks_before.get(k, 0)}

    p = lambda *a: print(*a, file=out)  # noqa: E731
    kind = "a tiny GLM-5-architecture model" if checkpoint is None else f"the model of {checkpoint}"
    p(f"glm5-hal demo: {kind}: {describe(config)}")
    p(f"weights: {source}; {str(model.dtype).removeprefix('torch.')} on {model.device}; dispatch: "
      + (f"pinned to backend {backend!r}" if backend else "default (best available backend per op)"))
    p(f"prompt ({len(prompt)} tokens): {' '.join(map(str, prompt))}")
    p(f"generated ({len(generated)} tokens): {' '.join(map(str, generated))}")
    if tokenizer is not None:
        p(f"prompt text: {tokenizer.decode(prompt)!r}")
        p(f"generated text: {tokenizer.decode(generated)!r}")
    rate = len(generated) / elapsed if elapsed > 0 else float("inf")
    p(f"speed: {len(generated)} tokens in {elapsed:.3f} s = {rate:.1f} tokens/s "
      f"(greedy, batch 1, prefill of {len(prompt)} tokens included)")
    p("")
    p(f"{'op':<24} {'prefill':>7} {'decode':>7}  implementation (hal.explain of a representative call)")
    for name, ex in chosen.items():
        tag = "  [fallback]" if ex.fallback else ""
        p(f"{name:<24} {prefill_calls.counts.get(name, 0):>7} {decode_calls.counts.get(name, 0):>7}  "
          f"{ex.chosen}{tag}")
        for who, why in ex.rejected:
            p(f"{'':<42}rejected {who}: {why}")
    p("(prefill: calls in one packed prefill of the prompt; decode: calls per generated token)")
    p("")
    if fallbacks:
        p("fallbacks to the reference while the demo ran (hal.fallback_stats()):")
        for (op, who, why), n in sorted(fallbacks.items()):
            p(f"  {op}: backend {who!r} declined ({why}): {n} calls")
    else:
        p("fallbacks to the reference while the demo ran: none")
    return {"prompt": prompt, "tokens": generated, "seconds": elapsed,
            "implementations": {k: v.chosen for k, v in chosen.items()},
            "fallback_ops": sorted(k for k, v in chosen.items() if v.fallback),
            "fallbacks": fallbacks,
            "prefill_calls": dict(prefill_calls.counts), "decode_calls": dict(decode_calls.counts)}


def _describe_checkpoint(info) -> str:
    formats = ", ".join(f"{n} {fmt if fmt == 'float' else fmt.upper()}"
                        for fmt, n in sorted(info.linear_formats.items()))
    text = (f"{info.weights.upper() if info.weights == 'fp8' else 'float'} checkpoint, {len(info.files)} file(s), "
            f"{info.bytes / 2**20:.1f} MiB read in {info.seconds:.2f} s; linear weights: {formats}")
    if info.quantize:
        text += f" (quantize={info.quantize!r} at load)"
    if info.skipped:
        text += f"; skipped {len(info.skipped)} MTP tensors"
    return text


def _tokenizer(checkpoint) -> Any:
    """The checkpoint's tokenizer.json through the `tokenizers` package, if both are there
    (glm5_hal does not depend on it); else None and the demo works on token ids."""
    path = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


def _trace_one_step(model: GLM5ForCausalLM, prompt: list[int]) -> tuple[OpCalls, OpCalls]:
    """The ops (and their first arguments) of one packed prefill and of one decode step."""
    cache = model.new_cache(-(-(len(prompt) + 1) // 16), 16)
    with record_ops() as prefill_calls:
        logits = model.prefill(cache, ["demo"], [prompt])
    with record_ops() as decode_calls:
        model.decode(cache, ["demo"], logits[-1:].argmax(-1))
    cache.free("demo")
    return prefill_calls, decode_calls
