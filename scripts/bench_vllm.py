#!/usr/bin/env python3
"""Decode tokens/s of a small GLM-5-architecture model served three ways, same weights, one run:

- vLLM + glm5_hal: vLLM 0.32 (CPU build) with glm5_hal.integrations.vllm (run in the vLLM venv);
- HF eager: transformers' GlmMoeDsaForCausalLM.generate(), attention and experts "eager";
- HF + glm5_hal: the same HF model after glm5_hal.integrations.transformers.apply().

    python scripts/bench_vllm.py [--vllm-python .venv-vllm/bin/python] [--hf-python .venv/bin/python]
        [--dtypes float32 bfloat16] [--batches 1 8] [--contexts 1024 8192] [--new 16] [--json F]

The model (`BENCH` below): 8 layers (1 dense), hidden 1024, 64 experts top-8, MLA with GLM-5's
cache row (latent 512 + rope 64), an indexer of 32 heads x 128 keeping the top 256; random
weights (HF's seeded init), saved once per dtype by transformers. Each point is a fresh
process per implementation; prompts are random token ids of the context length; decoding runs
`--new` tokens with ignore_eos. Decode time excludes the prefill: vLLM, as the difference
between a run of 1 + new tokens and a run of 1 token (prefix caching off, so the prefill is
redone); HF, the median step between generate()'s per-step stamps (glm5_hal.bench.hf_decode).

Roofline: a decode step must at least read every weight it uses (embedding row excluded: one
per token; the dense layer, attention, shared expert and lm_head always; the routed experts
the batch activates, expected count E * (1 - (1 - k/E)^batch) per MoE layer) and, per layer and
sequence, the indexer's FP8 keys over the whole context (132 bytes a token) and the `index_topk`
latent rows the sparse attention reads (576 values). The bound is those bytes over the
machine's triad bandwidth measured in the same run (glm5_hal.bench.roofline).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1,
             n_routed_experts=64, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=512,
             qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, first_k_dense_replace=1,
             max_position_embeddings=16384, index_topk=256, index_head_dim=128, index_n_heads=32,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=0, eos_token_id=1)


# -- workers (each runs in its own process) -----------------------------------------------------
def make_checkpoint(path: str, dtype: str) -> None:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    torch.manual_seed(0)
    GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**BENCH)).to(getattr(torch, dtype)).save_pretrained(path)


def prompts(batch: int, context: int) -> list[list[int]]:
    import random
    rng = random.Random(context * 100 + batch)
    return [[rng.randrange(2, BENCH["vocab_size"]) for _ in range(context)] for _ in range(batch)]


def vllm_decode(path: str, dtype: str, batch: int, context: int, new: int, repeats: int) -> dict:
    from vllm import LLM, SamplingParams
    llm = LLM(model=path, dtype=dtype, max_model_len=context + new + 8, enable_prefix_caching=False,
              max_num_seqs=max(batch, 1), skip_tokenizer_init=True, seed=0)
    batch_prompts = [{"prompt_token_ids": p} for p in prompts(batch, context)]

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(batch_prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        return time.perf_counter() - start
    timed(2)   # warm-up (compilation, allocation)
    decode = []
    for _ in range(repeats):
        prefill = timed(1)
        decode.append(timed(1 + new) - prefill)
    return {"tokens_per_s": batch * new / statistics.median(decode), "decode_s": decode}


def hf_decode(path: str, dtype: str, batch: int, context: int, new: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from glm5_hal.bench.hf_decode import _hf_steps
    from glm5_hal.integrations import transformers as hal_transformers
    hal_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    ids = torch.tensor(prompts(batch, context))
    out = {}
    for label, impl in (("HF eager", ("eager", "eager")), ("HF + glm5_hal", ("glm5_hal", "glm5_hal"))):
        steps: list[float] = []
        for _ in range(repeats):
            got, _ = _hf_steps(model, ids, new, impl)
            steps += got
        out[label] = batch / statistics.median(steps)
    return out


def triad() -> dict:
    from glm5_hal.bench import roofline
    r = roofline.measure(repeats=3)
    return {"triad_gbps": r.triad_gbps, "threads": r.threads}


# -- the roofline's bytes -----------------------------------------------------------------------
def step_bytes(dtype: str, batch: int, context: int) -> float:
    c, width = BENCH, 2 if dtype == "bfloat16" else 4
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (h * (c["q_lora_rank"] + c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["q_lora_rank"] * heads * qk
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * h
                 + c["q_lora_rank"] * c["index_n_heads"] * c["index_head_dim"]
                 + h * (c["index_head_dim"] + c["index_n_heads"]))
    expert = 3 * h * c["moe_intermediate_size"]
    experts, k = c["n_routed_experts"], c["num_experts_per_tok"]
    active = experts * (1 - (1 - k / experts) ** batch)
    dense_mlp = 3 * h * c["intermediate_size"]
    moe_layers = layers - c["first_k_dense_replace"]
    weights = (layers * attention + c["first_k_dense_replace"] * dense_mlp
               + moe_layers * (expert * (c["n_shared_experts"] + active) + h * experts)
               + c["vocab_size"] * h) * width
    row = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    kv = layers * batch * (context * (c["index_head_dim"] + 4) + min(context, c["index_topk"]) * row * width)
    return weights + kv


# -- driver -------------------------------------------------------------------------------------
def run_worker(python: str, fn: str, *args) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import bench_vllm as b; "
            f"print('RESULT ' + json.dumps(b.{fn}(*{list(args)!r})))")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{fn}{args} failed ({python}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    p.add_argument("--hf-python", default=str(ROOT / ".venv/bin/python"))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192])
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-hf-eager-above", type=int, default=None,
                   help="leave HF out at contexts above this (its eager prefill is quadratic in memory)")
    p.add_argument("--json")
    args = p.parse_args()
    machine = run_worker(args.hf_python, "triad")
    print(f"triad bandwidth {machine['triad_gbps']:.1f} GB/s, {machine['threads']} threads; decode {args.new} "
          f"tokens, median of {args.repeats}", flush=True)
    header = (f"{'dtype':<9} {'batch':>5} {'context':>7} {'vLLM+hal tok/s':>14} {'HF eager':>9} {'HF+hal':>8} "
              f"{'vs HF eager':>11} {'% roofline':>10}")
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            path = str(Path(tmp) / dtype)
            run_worker(args.hf_python, "make_checkpoint", path, dtype)
            for context in args.contexts:
                for batch in args.batches:
                    served = run_worker(args.vllm_python, "vllm_decode", path, dtype, batch, context, args.new,
                                        args.repeats)
                    hf = {}
                    if args.skip_hf_eager_above is None or context <= args.skip_hf_eager_above:
                        hf = run_worker(args.hf_python, "hf_decode", path, dtype, batch, context, args.new,
                                        args.repeats)
                    bound = machine["triad_gbps"] * 1e9 / step_bytes(dtype, batch, context) * batch
                    row = dict(dtype=dtype, batch=batch, context=context, vllm_glm5_hal=served["tokens_per_s"],
                               hf_eager=hf.get("HF eager"), hf_glm5_hal=hf.get("HF + glm5_hal"),
                               roofline_tokens_per_s=bound, step_bytes=step_bytes(dtype, batch, context))
                    rows.append(row)
                    vs = f"{row['vllm_glm5_hal'] / row['hf_eager']:.2f}x" if row["hf_eager"] else "-"
                    print(f"{dtype:<9} {batch:>5} {context:>7} {row['vllm_glm5_hal']:>14.2f} "
                          f"{row['hf_eager'] or float('nan'):>9.2f} {row['hf_glm5_hal'] or float('nan'):>8.2f} "
                          f"{vs:>11} {100 * row['vllm_glm5_hal'] / bound:>9.1f}%", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "model": BENCH, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
