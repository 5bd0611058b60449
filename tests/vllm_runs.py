"""Runs for tests/test_integrations_vllm.py, each in its own process (vLLM spawns its engine
and workers; a process per run keeps them apart). Every checkpoint is built here by HF
transformers from a seed: nothing is downloaded.

    python tests/vllm_runs.py checkpoint DIR --arch glm5|llama --dtype float32|bfloat16
    python tests/vllm_runs.py hf DIR --prompts JSON --max-tokens N
    python tests/vllm_runs.py vllm DIR --prompts JSON --max-tokens N [--then JSON] [--tp 2]
                                   [--max-num-batched-tokens N] [--no-prefix-caching] [--eager]

Each prints one line `RESULT <json>`.
"""
from __future__ import annotations

import argparse
import json
import sys

#: a GLM-5-architecture model small enough for a CPU test: 3 layers (one dense, two MoE of 8
#: experts top-2), GLM-5's MLA widths (latent 512, rope 64, so a 576-wide cache row) and an
#: indexer of 32 heads x 128 (GLM-5's) keeping the top 16 positions. With 32 heads a key's indexer
#: score is almost never exactly 0 (that needs all 32 relu(q . k) at 0); with 4, zero scores tie
#: at the top-k boundary and the two implementations may break the tie differently (both valid)
GLM5_TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                 n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=128,
                 qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64, first_k_dense_replace=1,
                 max_position_embeddings=1024, index_topk=16, index_head_dim=128, index_n_heads=32,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 bos_token_id=0, eos_token_id=1, pad_token_id=None)
LLAMA_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=0, eos_token_id=1)
#: lm_head scale: a random model's next-token logits are nearly flat; scaled up, greedy choices
#: have margins that float32 rounding differences between implementations cannot flip
LOGIT_SCALE = 50.0


def checkpoint(path: str, arch: str, dtype: str, seed: int) -> dict:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, LlamaConfig, LlamaForCausalLM,
                              PreTrainedTokenizerFast)
    torch.manual_seed(seed)
    if arch == "glm5":
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**GLM5_TINY))
    else:
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    return {"path": path}


def fp8_rows(x):
    """x with each row (last dim) through e4m3 with a power-of-two scale, as vLLM's DSA indexer
    holds its queries (per_token_group_quant_fp8, ue8m0) and its cached keys."""
    import torch
    amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def use_fp8_indexer_scores() -> None:
    """transformers' GLM-MoE-DSA indexer, its q . k taken on FP8-rounded q and k: the precision
    vLLM's DSA indexer computes in by design (FP8 queries and an FP8 key cache, as DeepSeek's
    reference); everything else stays transformers' own float32 computation."""
    import torch
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as modeling
    original = modeling.GlmMoeDsaIndexer.forward

    def forward(self, *args, **kwargs):
        matmul = torch.matmul

        def scores(a, b, *rest, **kw):
            if a.dim() == 4 and b.dim() == 4 and a.shape[-1] == self.head_dim and b.shape[-2] == self.head_dim:
                return matmul(fp8_rows(a), fp8_rows(b.transpose(-1, -2)).transpose(-1, -2))
            return matmul(a, b, *rest, **kw)
        torch.matmul = scores
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.matmul = matmul
    modeling.GlmMoeDsaIndexer.forward = forward


def hf(path: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy tokens of transformers' float32 model ("own") and of the same model with the
    FP8-scored indexer ("fp8"), each prompt alone (no padding in the reference)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def greedy() -> list[list[int]]:
        out = [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False) for p in prompts]
        return [o[0, len(p):].tolist() for o, p in zip(out, prompts)]
    own = greedy()
    use_fp8_indexer_scores()
    return {"own": own, "fp8": greedy()}


def vllm(path: str, prompts: list[list[int]], max_tokens: int, then: list[list[int]] | None, tp: int,
         max_num_batched_tokens: int | None, prefix_caching: bool, eager: bool, dtype: str) -> dict:
    from vllm import LLM, SamplingParams
    kwargs = dict(model=path, max_model_len=512, seed=0, tensor_parallel_size=tp, dtype=dtype,
                  enforce_eager=eager, enable_prefix_caching=prefix_caching)
    if max_num_batched_tokens:
        kwargs.update(max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True,
                      max_num_seqs=max(1, min(len(prompts), max_num_batched_tokens)))
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    config = llm.llm_engine.vllm_config
    result = {"block_size": config.cache_config.block_size,
              "prefix_caching": config.cache_config.enable_prefix_caching,
              "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
              "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens}
    for key, batch in (("first", prompts), ("then", then)):
        if batch:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            result[key] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                           "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs]}
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("checkpoint")
    c.add_argument("path")
    c.add_argument("--arch", default="glm5", choices=("glm5", "llama"))
    c.add_argument("--dtype", default="float32")
    c.add_argument("--seed", type=int, default=0)
    for name in ("hf", "vllm"):
        p = sub.add_parser(name)
        p.add_argument("path")
        p.add_argument("--prompts", required=True)
        p.add_argument("--max-tokens", type=int, default=8)
    v = sub.choices["vllm"]
    v.add_argument("--then")
    v.add_argument("--tp", type=int, default=1)
    v.add_argument("--max-num-batched-tokens", type=int)
    v.add_argument("--no-prefix-caching", action="store_true")
    v.add_argument("--eager", action="store_true")
    v.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    if args.cmd == "checkpoint":
        result = checkpoint(args.path, args.arch, args.dtype, args.seed)
    elif args.cmd == "hf":
        result = hf(args.path, json.loads(args.prompts), args.max_tokens)
    else:
        result = vllm(args.path, json.loads(args.prompts), args.max_tokens,
                      json.loads(args.then) if args.then else None, args.tp, args.max_num_batched_tokens,
                      not args.no_prefix_caching, args.eager, args.dtype)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
