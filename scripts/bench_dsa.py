"""Benchmark of the DSA decode ops at GLM-5 shapes (issue 5 targets), on the bench harness.

    .venv/bin/python scripts/bench_dsa.py [--context 32768] [--batch 4] [--no-compile]

Times, in one run: the reference (eager), torch.compile of the reference, and the `cpu`
backend, for sparse_mla_decode_paged, indexer_topk_paged (bfloat16 and FP8 keys) and
dense_mla_decode_paged, each against the fp32 GEMM roofline measured in the same run; then
the DSA decode step (indexer + sparse attention) against dense decode. Timings on a shared
machine are noisy: compare ratios within one run, repeat runs.
"""
from __future__ import annotations

import argparse
import logging
import math

import torch

import glm5_hal as hal
from glm5_hal.bench import roofline
from glm5_hal.bench.runner import BenchCase, format_table, run_case
from glm5_hal.bench.timing import median_time
from glm5_hal.presets import GLM5, GLM5_SM_SCALE


def paged_cache(g, batch, context, block_size, dim, dtype, fp8=False):
    blocks = math.ceil(context / block_size)
    table = torch.randperm(batch * blocks, generator=g).view(batch, blocks).to(torch.int32)
    values = torch.randn(batch * blocks, block_size, dim, generator=g)
    if fp8:
        scale = values.abs().amax(-1).clamp(min=1e-4) / 448
        values = ((values / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale)
    else:
        values = values.to(dtype)
    return values, table, torch.full((batch,), context, dtype=torch.int32)


def cases(batch: int, context: int, block_size: int, dtype: torch.dtype) -> list[BenchCase]:
    heads, dqk, d_v, topk = GLM5.num_heads, GLM5.d_qk, GLM5.d_v, GLM5.index_topk
    hi, di = GLM5.index_n_heads, GLM5.index_head_dim
    label = f"B={batch} ctx={context} {str(dtype).removeprefix('torch.')}"

    def attention_inputs():
        g = torch.Generator().manual_seed(0)
        cache, table, lens = paged_cache(g, batch, context, block_size, dqk, dtype)
        q = torch.randn(batch, 1, heads, dqk, generator=g).to(dtype)
        return g, q, cache, table, lens

    def sparse():
        g, q, cache, table, lens = attention_inputs()
        idx = torch.stack([torch.randperm(context, generator=g)[:topk] for _ in range(batch)])
        return q, cache, table, lens, idx.view(batch, 1, -1).to(torch.int32), GLM5_SM_SCALE, d_v

    def dense():
        _, q, cache, table, lens = attention_inputs()
        return q, cache, table, lens, GLM5_SM_SCALE, d_v

    def indexer(fp8):
        def make():
            g = torch.Generator().manual_seed(1)
            cache, table, lens = paged_cache(g, batch, context, block_size, di, dtype, fp8)
            q = torch.randn(batch, 1, hi, di, generator=g).to(dtype)
            w = torch.randn(batch, 1, hi, generator=g) * (hi * di) ** -0.5
            return q, cache, w, table, lens, topk
        return make

    attention_flops = 2 * batch * heads * (dqk + d_v)
    return [
        BenchCase("sparse_mla_decode_paged", f"{label} topk={topk}", sparse, flops=attention_flops * topk),
        BenchCase("indexer_topk_paged", f"{label} keys", indexer(False), flops=2 * batch * hi * di * context),
        BenchCase("indexer_topk_paged", f"{label} fp8 keys", indexer(True), flops=2 * batch * hi * di * context),
        BenchCase("dense_mla_decode_paged", label, dense, flops=attention_flops * context),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # the references' data-dependent sizes (.item()) make dynamo warn about graph breaks
    torch._logging.set_logs(dynamo=logging.ERROR)

    roof = roofline.measure()
    results = []
    for case in cases(args.batch, args.context, args.block_size, dtype):
        # compiling the dense reference at long contexts takes minutes and gigabytes
        compile_ref = not args.no_compile and case.op != "dense_mla_decode_paged"
        results.append((case, run_case(case, roof, ["cpu"], compile_reference=compile_ref, repeats=args.repeats)))
    print(format_table(results, roof))

    # DSA decode (indexer over every key, then attention over the top-k) vs dense decode
    by_label = {(c.op, c.label): c for c, _ in results}
    sparse_case = next(c for c, _ in results if c.op == "sparse_mla_decode_paged")
    dense_case = next(c for c, _ in results if c.op == "dense_mla_decode_paged")
    with hal.use("cpu"):
        sparse_args, dense_args = sparse_case.make(), dense_case.make()
        t_sparse = median_time(lambda: hal.ops.sparse_mla_decode_paged(*sparse_args), repeats=args.repeats)
        t_dense = median_time(lambda: hal.ops.dense_mla_decode_paged(*dense_args), repeats=args.repeats)
        for (op, label), case in by_label.items():
            if op != "indexer_topk_paged":
                continue
            idx_args = case.make()
            t_idx = median_time(lambda: hal.ops.indexer_topk_paged(*idx_args), repeats=args.repeats)
            print(f"DSA decode ({label}): indexer {t_idx * 1e3:.2f} ms + sparse attention {t_sparse * 1e3:.2f} ms "
                  f"= {(t_idx + t_sparse) * 1e3:.2f} ms vs dense {t_dense * 1e3:.2f} ms: "
                  f"{t_dense / (t_idx + t_sparse):.1f}x faster")


if __name__ == "__main__":
    main()
