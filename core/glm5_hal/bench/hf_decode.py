"""Decode tokens/s of one GLM-5-architecture model run three ways, same weights, same run
(`glm5-hal bench --hf-decode`, needs `pip install 'glm5-hal[transformers]'`):

- HF eager: transformers' `GlmMoeDsaForCausalLM.generate()` with `attn_implementation="eager"`,
  `experts_implementation="eager"` (and, for reference, HF's defaults "sdpa" + "grouped_mm");
- HF + glm5_hal: the same model object after `glm5_hal.integrations.transformers.apply`;
- glm5_hal.models: `GLM5ForCausalLM` holding the very same weight tensors, paged cache.

Each decode step is timed on its own (HF: a stopping criterion stamps the clock after every
step; glm5_hal.models: around `decode`), prefill excluded; a row reports the median step
over every repeat, as tokens/s = batch / median step. Implementations alternate within each
repeat, so they share the machine's load. The greedy tokens of all of them are compared.
Weights are HF's random initialisation (std 0.02), seeded.
"""
from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch

#: HF GlmMoeDsaConfig fields of the two configs. tiny: glm5_hal.models' `GLM5Config.tiny()`.
#: mid: hidden 2048, 8 layers (1 dense), 64 experts top-8, DeepSeek-V3-like head dims.
CONFIGS = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                 n_routed_experts=8, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32,
                 qk_nope_head_dim=32, num_experts_per_tok=2, index_topk=8, index_head_dim=32, index_n_heads=16,
                 first_k_dense_replace=1),
    "mid": dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=256,
                num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1,
                n_routed_experts=64, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, num_experts_per_tok=8, index_topk=256, index_head_dim=128, index_n_heads=32,
                first_k_dense_replace=1),
}
ROPE = {"rope_type": "default", "rope_theta": 1e6}
#: (config, batch, prompt tokens, decoded tokens). HF eager's decode step grows with the
#: context (it re-expands every cached latent through kv_b_proj), hence the context sweep.
CASES = (("tiny", 1, 32, 32), ("mid", 1, 128, 8), ("mid", 1, 512, 8), ("mid", 1, 1024, 8), ("mid", 4, 128, 8))
#: The tiny config runs single-threaded: its matrices are too small to gain from intra-op
#: threads, and spinning threads stall on a shared machine (docs/models.md, the demo).
THREADS = {"tiny": 1}
#: label -> (attn_implementation, experts_implementation); None: glm5_hal.models
IMPLEMENTATIONS = {"HF eager": ("eager", "eager"), "HF sdpa+grouped_mm": ("sdpa", "grouped_mm"),
                   "HF + glm5_hal": ("glm5_hal", "glm5_hal"), "glm5_hal.models": None}
BASELINE, TARGET = "HF eager", "HF + glm5_hal"


def build(name: str, seed: int = 0):
    """The HF model (HF's seeded random init) and a `GLM5ForCausalLM` sharing its tensors."""
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    from ..integrations import transformers as hal_transformers
    from ..models import GLM5Config, GLM5ForCausalLM
    config = GlmMoeDsaConfig(**CONFIGS[name], rope_parameters=dict(ROPE))
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                          experts_implementation="eager", dtype=torch.float32).eval()
    hal_transformers.register()
    with torch.device("meta"):            # no second copy: the tensors are HF's
        ours = GLM5ForCausalLM(GLM5Config.from_hf_config(config))
    loaded = ours.load_state_dict({**dict(hf.named_parameters()), **dict(hf.named_buffers())},
                                  strict=False, assign=True)
    assert not loaded.missing_keys, loaded.missing_keys
    return hf, ours


class _StepClock:
    """A stopping criterion that never stops: it stamps the clock after each generate() step."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _hf_steps(model, prompts: torch.Tensor, new: int, impl: tuple[str, str]) -> tuple[list[float], list]:
    from transformers import StoppingCriteriaList
    model.set_attn_implementation(impl[0])
    model.set_experts_implementation(impl[1])
    clock = _StepClock()
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new + 1, min_new_tokens=new + 1, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0)
    stamps = clock.stamps      # stamps[0]: after the prefill's token; then one per decode step
    return [b - a for a, b in zip(stamps, stamps[1:])], out[:, prompts.shape[1]:].tolist()


def _models_steps(model, prompts: torch.Tensor, new: int) -> tuple[list[float], list]:
    seqs = list(range(prompts.shape[0]))
    cache = model.new_cache(prompts.shape[0] * -(-(prompts.shape[1] + new + 1) // 16), 16)
    logits = model.prefill(cache, seqs, prompts.tolist())
    tokens = logits[torch.arange(1, len(seqs) + 1) * prompts.shape[1] - 1].argmax(-1)
    out, steps = [tokens.tolist()], []
    for _ in range(new):
        t0 = time.perf_counter()
        tokens = model.decode(cache, seqs, tokens).argmax(-1)
        out.append(tokens.tolist())
        steps.append(time.perf_counter() - t0)
    return steps, [list(t) for t in zip(*out)]


def run_case(hf, ours, config: str, batch: int, prompt: int, new: int, repeats: int) -> dict:
    prompts = torch.randint(1, hf.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    steps: dict[str, list[float]] = {label: [] for label in IMPLEMENTATIONS}
    tokens: dict[str, list] = {}
    for _ in range(repeats):
        for label, impl in IMPLEMENTATIONS.items():
            got, tokens[label] = (_models_steps(ours, prompts, new) if impl is None
                                  else _hf_steps(hf, prompts, new, impl))
            steps[label] += got
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    per_s = {label: batch / statistics.median(s) for label, s in steps.items()}
    return {"config": config, "batch": batch, "prompt": prompt, "new_tokens": new, "repeats": repeats,
            "threads": torch.get_num_threads(), "tokens_per_s": per_s,
            "speedup": per_s[TARGET] / per_s[BASELINE],
            "tokens_agree": all(t == tokens[BASELINE] for t in tokens.values())}


def run(configs=("tiny", "mid"), repeats: int = 3, on_row=None) -> list[dict]:
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # HF's generation-config notices
        for name in configs:
            hf, ours = build(name)
            threads = torch.get_num_threads()
            torch.set_num_threads(THREADS.get(name, threads))
            try:
                for config, batch, prompt, new in CASES:
                    if config == name:
                        row = run_case(hf, ours, config, batch, prompt, new, repeats)
                        rows.append(row)
                        if on_row:
                            on_row(row)
            finally:
                torch.set_num_threads(threads)
            del hf, ours
    return rows


def format_header() -> str:
    return (f"{'config':<6} {'batch':>5} {'prompt':>6} {'thr':>3} " + " ".join(f"{label:>19}" for label in IMPLEMENTATIONS)
            + f" {'glm5_hal/eager':>14}  tokens agree")


def format_row(row: dict) -> str:
    rates = " ".join(f"{row['tokens_per_s'][label]:>19.2f}" for label in IMPLEMENTATIONS)
    return (f"{row['config']:<6} {row['batch']:>5} {row['prompt']:>6} {row['threads']:>3} {rates} {row['speedup']:>13.2f}x  "
            f"{'yes' if row['tokens_agree'] else 'NO'}")


def command(args) -> int:
    """`glm5-hal bench --hf-decode [--preset tiny] [--repeats N] [--json F]`."""
    import json
    try:
        import transformers  # noqa: F401
    except ImportError:
        from ..errors import HalError
        raise HalError("bench --hf-decode needs transformers: pip install 'glm5-hal[transformers]'") from None
    configs = ("tiny",) if args.preset == "tiny" else ("tiny", "mid")
    print(f"decode tokens/s (median step, prefill excluded; float32; threads: tiny 1, mid {torch.get_num_threads()})")
    print(format_header(), flush=True)
    rows = run(configs, repeats=args.repeats, on_row=lambda r: print(format_row(r), flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hf_decode": rows, "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__}, f, indent=2)
        print(f"wrote {args.json}")
    return 0
