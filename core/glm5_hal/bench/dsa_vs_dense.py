"""DSA decode against dense decode over context length (`glm5-hal bench --dsa-vs-dense`).

At each context: one GLM-5 decode step of the attention -- the DSA path, `indexer_topk_paged`
(FP8 keys, 32 heads x 128, top-2048) followed by `sparse_mla_decode_paged` over the selected
positions, against `dense_mla_decode_paged` over every position -- for a batch of 4
sequences, 64 heads, d_qk 576, d_v 512, bfloat16, on whichever backend dispatch chooses
(the best available one). The indexer's output feeds the sparse attention, as in the model.
The DSA path is linear in context through the indexer only; dense attention is linear in
context with a ~9x larger constant (2 * H * (d_qk + d_v) = 139264 flops per key against the
indexer's 2 * 32 * 128 = 8192), so DSA wins once the context exceeds the top-k by a margin.
"""
from __future__ import annotations

import glm5_hal as hal

from ..presets import GLM5, GLM5_SM_SCALE
from .cases import BF16, F32, I32, paged, randn, seeded
from .timing import median_time

DEFAULT_CONTEXTS = (2048, 4096, 8192, 16384, 32768, 65536)


def sweep(contexts=DEFAULT_CONTEXTS, batch: int = 4, block_size: int = 64, repeats: int = 5,
          min_time: float = 0.2, on_row=None) -> list[dict]:
    heads, dqk, dv, topk = GLM5.num_heads, GLM5.d_qk, GLM5.d_v, GLM5.index_topk
    hi, di = GLM5.index_n_heads, GLM5.index_head_dim
    rows = []
    for ctx in contexts:
        g = seeded(f"dsa-{ctx}")
        cache, table, lens = paged(g, batch, ctx, block_size, dqk)
        keys, _, _ = paged(g, batch, ctx, block_size, di, fp8=True)
        q = randn(g, (batch, 1, heads, dqk), BF16)
        qi = randn(g, (batch, 1, hi, di), BF16)
        w = randn(g, (batch, 1, hi), F32, (hi * di) ** -0.5)
        indexer_args = (qi, keys, w, table, lens, topk)
        indices = hal.ops.indexer_topk_paged(*indexer_args).to(I32)
        sparse_args = (q, cache, table, lens, indices, GLM5_SM_SCALE, dv)
        dense_args = (q, cache, table, lens, GLM5_SM_SCALE, dv)
        t_idx = median_time(lambda: hal.ops.indexer_topk_paged(*indexer_args), repeats=repeats, min_time=min_time)
        t_sparse = median_time(lambda: hal.ops.sparse_mla_decode_paged(*sparse_args), repeats=repeats,
                               min_time=min_time)
        t_dense = median_time(lambda: hal.ops.dense_mla_decode_paged(*dense_args), repeats=repeats, min_time=min_time)
        row = {"context": ctx, "batch": batch, "topk": topk,
               "indexer_ms": t_idx * 1e3, "sparse_ms": t_sparse * 1e3, "dsa_ms": (t_idx + t_sparse) * 1e3,
               "dense_ms": t_dense * 1e3, "dense_over_dsa": t_dense / (t_idx + t_sparse),
               "indexer_impl": hal.explain("indexer_topk_paged", *indexer_args).chosen,
               "sparse_impl": hal.explain("sparse_mla_decode_paged", *sparse_args).chosen,
               "dense_impl": hal.explain("dense_mla_decode_paged", *dense_args).chosen}
        rows.append(row)
        if on_row:
            on_row(row)
        del cache, keys, indices
    return rows


def format_header() -> str:
    return (f"{'context':>8} {'indexer ms':>11} {'sparse ms':>10} {'DSA ms':>9} {'dense ms':>10} "
            f"{'dense/DSA':>10}  implementations")


def format_row(r: dict) -> str:
    impls = ", ".join(sorted({r["indexer_impl"], r["sparse_impl"], r["dense_impl"]}))
    return (f"{r['context']:>8} {r['indexer_ms']:>11.3f} {r['sparse_ms']:>10.3f} {r['dsa_ms']:>9.3f} "
            f"{r['dense_ms']:>10.3f} {r['dense_over_dsa']:>9.2f}x  {impls}")


def plot(rows: list[dict], path: str) -> None:
    """Writes a PNG of decode time against context (needs matplotlib: the `plot` extra)."""
    try:
        import matplotlib
    except ImportError:
        from ..errors import HalError
        raise HalError("bench --plot needs matplotlib: pip install 'glm5-hal[plot]' "
                       "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ctx = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ctx, [r["dense_ms"] for r in rows], "o-", label="dense_mla_decode_paged")
    ax.plot(ctx, [r["dsa_ms"] for r in rows], "o-", label="DSA: indexer_topk_paged + sparse_mla_decode_paged")
    ax.plot(ctx, [r["indexer_ms"] for r in rows], ".--", label="  of which indexer_topk_paged")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step, ms (batch 4, 64 heads)")
    impls = sorted({r[k] for r in rows for k in ("indexer_impl", "sparse_impl", "dense_impl")})
    ax.set_title(f"GLM-5 attention decode: DSA (top-{rows[0]['topk']}) vs dense\n{', '.join(impls)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

