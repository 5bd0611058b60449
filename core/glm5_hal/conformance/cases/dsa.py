"""Cases for the DSA ops (docs/ops/dsa.md): the lightning indexer (logits, top-k, paged
top-k) and MLA attention in absorbed mode (sparse, sparse paged decode, dense paged decode).

How each output is judged (docs/conformance.md, "DSA ops"):
- indexer logits: `Close` in float32 (the contract's output dtype for every q dtype),
  widened x4 for the order-free fp32 reductions; `-inf` outside each row's range must match.
- top-k indices: `TopKSet` against the float64 reference logits, with tau = twice the logits
  bound (a swap moves two scores, each within that bound).
- attention: `out` in q's dtype (fp32 widened x4 for the softmax-weighted sum; every dtype
  x4 in the peaked cases), `lse` in float32 widened x2; rows without a valid key must give
  `lse = -inf` exactly (and out 0).

Inputs follow the model's scales: indexer q and k ~ N(0, 1) (after Hadamard), weights
~ N(0, 1) * (Hi * D)^-0.5, so logits are O(1); MLA q and latent rows ~ N(0, 1) with
sm_scale = 256^-0.5. Paged caches hand out physical blocks in shuffled order, and every
slot no sequence owns holds "poison" (large random rows), so a kernel that reads a slot it
must ignore changes its answer visibly.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ... import reference as ref
from ...presets import GLM5, GLM5_SM_SCALE
from ..case import ERROR, RESULT, RESULT_OR_ERROR, Case, View, expected_errors, randn
from ..compare import Close, TopKSet
from ..tolerance import tolerance
from . import generator

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
I32 = torch.int32
D_INDEX = GLM5.index_head_dim        # 128
HI_GLM5 = GLM5.index_n_heads         # 32
TOPK_GLM5 = GLM5.index_topk          # 2048
H_GLM5 = GLM5.num_heads              # 64
D_QK, D_V = GLM5.d_qk, GLM5.d_v      # 576, 512
BLOCK_GLM5 = 64                      # FlashMLA's paged-cache block size
POISON_SCALE = 30.0                  # slots no sequence owns: rows of N(0, 30^2)

# -- tolerances -------------------------------------------------------------------------------
LOGITS_WIDEN = 4
LOGITS = Close(dtype=torch.float32, widen=LOGITS_WIDEN,
               why="fp32 dot products over D=128, then a signed sum over Hi heads, in any order")
#: A backend's k-th score is within the logits bound of the reference k-th, and so is each
#: selected key's score: a legitimate swap can put a key up to twice the bound below.
TAU = tolerance(torch.float32, 2 * LOGITS_WIDEN,
                "a within-tolerance swap moves two logits, each within the indexer_logits bound")
_OUT_FP32 = Close(widen=4, why="fp32 softmax-weighted sum over up to top-k rows, in any order "
                               "(online softmax rescales partial sums)")
_LSE = Close(dtype=torch.float32, widen=2,
             why="logsumexp of up to top-k fp32 scores: exp/log implementations and rescaling order are free")
#: Scores ~100 (the peaked cases): their fp32 rounding alone moves each softmax weight by
#: ~1e-5 relative, which reaches the base atol of every output dtype.
_OUT_PEAKED = Close(widen=4, why="scores ~100: their fp32 rounding alone moves each softmax weight by ~1e-5")


#: Flash kernels (FlashMLA, the Ascend sparse-attention golden, ...) round the softmax weights P
#: to the activation dtype for the P @ V product, accumulating it in float32 as the contract
#: asks. Each weight then carries one rounding, so an output element may move by up to
#: u * sum_j p_j |v_j| (u: the dtype's unit roundoff): far below the dtype's own bound unless
#: the output is a small sum of larger terms, where a uniform widening would loosen every
#: element instead.
_P_ROUNDING_WHY = "P may be rounded to the activation dtype for P @ V: u * sum_j p_j |v_j| per element"
_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _weighted_abs_values(q, rows, valid, sm_scale, d_v):
    """sum_j p_j |v_j| for q [..., H, Dqk] over rows [..., K, Dqk] where valid [..., K]:
    the softmax weights of the attention, applied to the values' magnitudes."""
    scores = torch.matmul(q, rows.transpose(-1, -2)) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(-2), -math.inf)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)     # a row without a valid key: no weight
    return torch.matmul(p, rows[..., :d_v].abs())


def _sparse_rows(kv, indices):
    valid = (indices >= 0) & (indices < kv.shape[0])
    if kv.shape[0] == 0:
        return kv.new_zeros((*indices.shape, kv.shape[1])), valid
    return kv[indices.long().clamp(0, kv.shape[0] - 1)], valid


def _logical_rows(kv_cache, block_table, positions, valid):
    """The cache rows of logical `positions` [B, N, K] (any row where not `valid`)."""
    block_size = kv_cache.shape[1]
    p = positions.long().clamp(min=0)
    blocks = block_table.long().gather(1, (p // block_size).clamp(max=block_table.shape[1] - 1).flatten(1))
    slots = (blocks.view_as(p) * block_size + p % block_size).masked_fill(~valid, 0)
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    if flat.shape[0] == 0:
        return kv_cache.new_zeros((*positions.shape, kv_cache.shape[-1]))
    return flat[slots.clamp(0, flat.shape[0] - 1)]


def _p_rounding_slack(op: str, dtype: torch.dtype):
    u = _UNIT_ROUNDOFF[dtype]

    def slack(*args):
        if op == "sparse_mla_attention":
            q, kv, indices, sm_scale, d_v = args
            rows, valid = _sparse_rows(kv, indices)
        else:
            q, kv_cache, block_table, context_lens = args[:4]
            sm_scale, d_v = args[-2:]
            lens = context_lens.long().view(-1, 1, 1)
            if op == "sparse_mla_decode_paged":
                positions = args[4]
                valid = (positions >= 0) & (positions < lens)
            else:   # dense: query i of N sees [0, context_lens[b] - N + i + 1)
                batch, n = q.shape[0], q.shape[1]
                length = max(int(context_lens.max()) if context_lens.numel() else 0, 1)
                positions = torch.arange(length).expand(batch, n, length)
                visible = lens - n + torch.arange(n).view(1, -1, 1) + 1
                valid = positions < visible
            if block_table.shape[1] == 0:
                return torch.zeros(())
            rows = _logical_rows(kv_cache, block_table, positions, valid)
        return u * _weighted_abs_values(q, rows, valid, sm_scale, d_v)
    return slack


def _attention_checks(op: str, dtype: torch.dtype, peaked: bool = False) -> dict:
    # half outputs: the final rounding of out dominates every accumulation error
    base = _OUT_PEAKED if peaked else _OUT_FP32 if dtype == torch.float32 else Close()
    why = f"{base.why}; {_P_ROUNDING_WHY}" if base.why else _P_ROUNDING_WHY
    out = dataclasses.replace(base, slack=_p_rounding_slack(op, dtype), why=why)
    return {"out[0]": out, "out[1]": _LSE}


def _topk_scores(q, k, weights, k_start, k_end, topk):
    return ref.indexer_logits(q, k, weights, k_start, k_end)


def paged_indexer_scores(q, k_cache, weights, block_table, context_lens, topk):
    """[B, N, L] reference logits of every logical key position (L = longest context) for
    query i of sequence b, `-inf` outside [0, context_lens[b] - N + i + 1). Built by reading
    each sequence's keys through its block table one position at a time, then
    `indexer_logits` on that contiguous sequence: independent of the paged reference."""
    fp8 = isinstance(k_cache, tuple)
    values = k_cache[0] if fp8 else k_cache
    block_size, dim = values.shape[1], values.shape[2]
    batch, queries = q.shape[0], q.shape[1]
    table, lens = block_table.tolist(), context_lens.tolist()   # plain ints: no per-element sync
    length = max(lens, default=0)
    rows = []
    for b in range(batch):
        n = lens[b]
        slots = [table[b][p // block_size] * block_size + p % block_size for p in range(n)]
        slots += [slots[0] if slots else 0] * (length - n)    # filler rows, masked below
        index = torch.tensor(slots, dtype=torch.long, device=values.device)
        if fp8:
            keys = (values.reshape(-1, dim)[index], k_cache[1].reshape(-1)[index])
        else:
            keys = values.reshape(-1, dim)[index]
        visible = [max(0, n - queries + i + 1) for i in range(queries)]
        rows.append(ref.indexer_logits(q[b], keys, weights[b], torch.zeros(queries, dtype=I32, device=q.device),
                                       torch.tensor(visible, dtype=I32, device=q.device)))
    if not rows:
        return q.new_zeros((0, queries, length))
    return torch.stack(rows)


# -- paged layouts ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Paging:
    """A paged cache layout. Each sequence's blocks are drawn in shuffled order from a pool
    of physical blocks; `spare` blocks belong to nobody.

    extra_blocks: block-table columns past the longest sequence's used blocks.
    padding: what fills table entries past a sequence's used blocks: "minus_one" or
        "garbage" (out-of-range ids, negative and huge), which a backend must never read.
    share_prefix: sequence 1 reuses sequence 0's first blocks (prefix caching).
    """
    contexts: tuple[int, ...]
    block_size: int
    extra_blocks: int = 1
    padding: str = "minus_one"
    spare: int = 2
    share_prefix: int = 0

    def layout(self, g: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(num_blocks, block_table int32 [B, max_blocks], context_lens int32 [B],
        owned bool [num_blocks, block_size]: slots holding a live logical position)."""
        bs = self.block_size
        used = [math.ceil(c / bs) for c in self.contexts]
        max_blocks = max(used, default=0) + self.extra_blocks
        fresh = sum(used) - self.share_prefix
        num_blocks = fresh + self.spare
        pool = torch.randperm(num_blocks, generator=g).tolist()
        table = torch.full((len(self.contexts), max_blocks), -1, dtype=I32)
        for b, n in enumerate(used):
            for j in range(n):
                table[b, j] = table[0, j] if b == 1 and j < self.share_prefix else pool.pop()
            if self.padding == "garbage":
                junk = (-7, num_blocks, 2 ** 31 - 1)
                for j in range(n, max_blocks):
                    table[b, j] = junk[j % len(junk)]
        owned = torch.zeros(num_blocks * bs, dtype=torch.bool)
        for b, c in enumerate(self.contexts):
            for p in range(c):
                owned[int(table[b, p // bs]) * bs + p % bs] = True
        return num_blocks, table, torch.tensor(self.contexts, dtype=I32), owned.view(num_blocks, bs)


def _paged_rows(g, num_blocks: int, block_size: int, dim: int, dtype, owned) -> torch.Tensor:
    """[num_blocks, block_size, dim] rows ~ N(0, 1); unowned slots hold poison."""
    rows = torch.randn(num_blocks, block_size, dim, generator=g)
    poison = torch.randn(num_blocks, block_size, dim, generator=g) * POISON_SCALE
    return torch.where(owned.unsqueeze(-1), rows, poison).to(dtype)


def _fp8_rows(values: torch.Tensor, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows with one float32 scale per row (indexer_k_cache_write's format)."""
    q, scale = ref.fp8_block_quant(values.float(), values.shape[-1], scale_fmt)
    return q, scale.squeeze(-1)


# -- indexer ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ranges:
    """Per-query key ranges [k_start, k_end) over `num_keys` keys."""
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    num_keys: int

    @staticmethod
    def packed(seqs) -> "Ranges":
        """A packed prefill batch; `seqs` = ((cached, new), ...): sequence b's keys are its
        `cached` earlier tokens then its `new` tokens, at offset o; its new token j (position
        cached + j) sees [o, o + cached + j + 1)."""
        starts, ends, offset = [], [], 0
        for cached, new in seqs:
            for j in range(new):
                starts.append(offset)
                ends.append(offset + cached + j + 1)
            offset += cached + new
        return Ranges(tuple(starts), tuple(ends), offset)

    @staticmethod
    def tail(num_keys: int, queries: int) -> "Ranges":
        """The last `queries` tokens of one causal sequence of `num_keys` tokens."""
        return Ranges((0,) * queries, tuple(range(num_keys - queries + 1, num_keys + 1)), num_keys)

    @property
    def tokens(self) -> int:
        return len(self.starts)


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
    name: str
    ranges: Ranges
    heads: int
    topk: int
    dim: int = D_INDEX
    keys: str = "float"          # "float" | "fp8" | "fp8_ue8m0"
    view: bool = False           # every input a non-contiguous view
    tied: bool = False           # all keys equal: every in-range logit of a row ties
    weight_sign: float = 0.0     # 0: signed weights; -1: all negative (top-k = least activated)
    model_weights: bool = False  # weights rounded through q's dtype (a bf16/fp16 weights_proj)
    outcome: str = RESULT
    note: str = ""


def _indexer_args(g, spec: IndexerSpec, dtype):
    t, hi, d, s = spec.ranges.tokens, spec.heads, spec.dim, spec.ranges.num_keys
    wscale = (hi * d) ** -0.5
    if spec.view:
        q = View(randn(g, (hi, t, d), dtype), lambda b: b.transpose(0, 1))
        k = View(randn(g, (s, d + 64), dtype), lambda b: b[:, :d])
        w = View(randn(g, (hi, t), torch.float32, wscale), lambda b: b.T)
        pairs = torch.tensor(list(zip(spec.ranges.starts, spec.ranges.ends)), dtype=I32).reshape(t, 2)
        return q, k, w, View(pairs, lambda b: b[:, 0]), View(pairs.clone(), lambda b: b[:, 1])
    q = randn(g, (t, hi, d), dtype)
    keys = torch.randn(s, d, generator=g)
    if spec.tied:
        keys = keys[:1].expand(s, d).clone()
    if spec.keys == "float":
        k = keys.to(dtype)
    else:
        k = _fp8_rows(keys, "ue8m0" if spec.keys == "fp8_ue8m0" else None)
    w = torch.randn(t, hi, generator=g) * wscale
    if spec.weight_sign:
        w = w.abs() * spec.weight_sign
    if spec.model_weights:
        w = w.to(dtype).float()
    return (q, k, w, torch.tensor(spec.ranges.starts, dtype=I32),
            torch.tensor(spec.ranges.ends, dtype=I32))


def _indexer_specs(preset: str) -> list[IndexerSpec]:
    if preset == "tiny":
        specs = [
            IndexerSpec("t1_h1_keys1", Ranges((0,), (1,), 1), heads=1, topk=1),
            IndexerSpec("t3_h3_keys17", Ranges((0, 0, 0), (17, 17, 17), 17), heads=3, topk=3),
            IndexerSpec("causal_t129_h17", Ranges.packed([(0, 129)]), heads=17, topk=17,
                        note="one causal sequence: rows 0..15 have fewer keys than top-k"),
            IndexerSpec("packed_3_17_1", Ranges.packed([(0, 3), (0, 17), (0, 1)]), heads=17, topk=17,
                        note="packed causal batch: per-token ranges start at each sequence's offset"),
            IndexerSpec("chunked_prefill", Ranges.packed([(40, 3), (0, 5), (129, 2)]), heads=3, topk=129,
                        note="prefill chunks after cached tokens: ranges include the cached keys"),
            IndexerSpec("empty_rows", Ranges((0, 5, 9, 17), (17, 5, 12, 17), 17), heads=3, topk=3,
                        note="rows with k_start == k_end: all -inf, top-k all -1"),
            IndexerSpec("topk_exceeds_keys", Ranges((0, 3, 0), (17, 17, 1), 17), heads=3, topk=129,
                        note="top-k larger than S: every row -1 padded"),
            IndexerSpec("no_keys", Ranges((0, 0), (0, 0), 0), heads=3, topk=3, note="S = 0"),
            IndexerSpec("empty_batch", Ranges((), (), 17), heads=3, topk=3),
            IndexerSpec("tied_keys", Ranges((0, 2), (17, 9), 17), heads=3, topk=3, tied=True,
                        note="all keys equal: any distinct choice is right, the count must be exact"),
            IndexerSpec("negative_weights", Ranges.packed([(0, 17)]), heads=3, topk=3, weight_sign=-1.0,
                        note="logits <= 0: top-k picks the least activated keys"),
            IndexerSpec("head_dim33", Ranges.packed([(0, 17)]), heads=3, topk=3, dim=33,
                        note="head dim other than 128 (the op allows any D)"),
            IndexerSpec("fp8_keys", Ranges.packed([(0, 3), (0, 17), (0, 1)]), heads=17, topk=17, keys="fp8"),
            IndexerSpec("fp8_keys_ue8m0", Ranges.packed([(40, 3), (0, 5)]), heads=3, topk=17,
                        keys="fp8_ue8m0", note="power-of-two key scales"),
            IndexerSpec("noncontig_views", Ranges.packed([(0, 3), (0, 17)]), heads=3, topk=17, view=True,
                        outcome=RESULT_OR_ERROR),
            IndexerSpec("model_weights_causal_t129", Ranges.packed([(0, 129)]), heads=17, topk=17,
                        model_weights=True, note="weights as a model computes them: a bf16/fp16 "
                        "weights_proj output in float32 (what vendor ops taking q-dtype weights serve)"),
        ]
    else:
        tail = Ranges.tail(5001, 2)
        two = Ranges((0, 3000, 3000), (3000, 4001, 5500), 5500)
        specs = [
            IndexerSpec("prefill_tail_keys5001", tail, HI_GLM5, TOPK_GLM5,
                        note="the last two tokens of a 5001-token prefill"),
            IndexerSpec("packed_keys3000_2500", two, HI_GLM5, TOPK_GLM5,
                        note="two packed sequences; one query sees 1001 keys (< top-k, -1 padded)"),
            IndexerSpec("fp8_keys_prefill_tail", tail, HI_GLM5, TOPK_GLM5, keys="fp8"),
            IndexerSpec("fp8_keys_ue8m0_packed", two, HI_GLM5, TOPK_GLM5, keys="fp8_ue8m0"),
        ]
    return specs


def _indexer_errors(preset: str):
    """(name, ranges, note): ranges the contract rejects (0 <= k_start <= k_end <= S)."""
    if preset != "tiny":
        return []
    return [("k_end_beyond_keys", Ranges((0, 0), (17, 18), 17), "k_end = S + 1"),
            ("k_start_after_k_end", Ranges((0, 9), (17, 8), 17), "k_start > k_end"),
            ("negative_k_start", Ranges((-1, 0), (3, 17), 17), "k_start < 0")]


def _indexer_cases(op: str, preset: str, topk: bool):
    for dtype in FLOATS:
        for spec in _indexer_specs(preset):
            def inputs(g, spec=spec, dtype=dtype):
                args = _indexer_args(g, spec, dtype)
                return (*args, spec.topk) if topk else args
            check = TopKSet(scores=_topk_scores, tau=TAU) if topk else LOGITS
            yield Case(op, preset, spec.name, dtype, inputs, {"out": check}, outcome=spec.outcome,
                       note=spec.note)
        for name, ranges, note in _indexer_errors(preset):
            spec = IndexerSpec(name, ranges, heads=3, topk=3)
            def inputs(g, spec=spec, dtype=dtype):
                args = _indexer_args(g, spec, dtype)
                return (*args, spec.topk) if topk else args
            yield Case(op, preset, name, dtype, inputs, outcome=ERROR, note=note)


@generator("indexer_logits")
def indexer_logits_cases(preset: str):
    yield from _indexer_cases("indexer_logits", preset, topk=False)


@generator("indexer_topk")
def indexer_topk_cases(preset: str):
    yield from _indexer_cases("indexer_topk", preset, topk=True)


# -- paged indexer ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PagedIndexerSpec:
    name: str
    paging: Paging
    queries: int
    heads: int
    topk: int
    keys: str = "float"
    view: bool = False
    model_weights: bool = False  # weights rounded through q's dtype (see IndexerSpec)
    outcome: str = RESULT
    note: str = ""


def _paged_indexer_args(g, spec: PagedIndexerSpec, dtype):
    p = spec.paging
    num_blocks, table, lens, owned = p.layout(g)
    b, n, hi = len(p.contexts), spec.queries, spec.heads
    keys = _paged_rows(g, num_blocks, p.block_size, D_INDEX, torch.float32, owned)
    cache = keys.to(dtype) if spec.keys == "float" else _fp8_rows(keys, None)
    wscale = (hi * D_INDEX) ** -0.5
    if spec.view:
        q = View(randn(g, (b, hi, n, D_INDEX), dtype), lambda t: t.transpose(1, 2))
        w = View(randn(g, (b, n, hi + 5), torch.float32, wscale), lambda t, hi=hi: t[..., :hi])
        wide = torch.cat([table, torch.full_like(table, -1)], dim=1)
        return q, cache, w, View(wide, lambda t, m=table.shape[1]: t[:, :m]), lens, spec.topk
    q = randn(g, (b, n, hi, D_INDEX), dtype)
    w = randn(g, (b, n, hi), torch.float32, wscale)
    if spec.model_weights:
        w = w.to(dtype).float()
    return q, cache, w, table, lens, spec.topk


def _paged_indexer_specs(preset: str) -> list[PagedIndexerSpec]:
    P = PagedIndexerSpec
    if preset == "tiny":
        return [
            P("b1_n1_bs1", Paging((3,), 1), queries=1, heads=1, topk=1),
            P("b3_n1_bs3", Paging((1, 17, 7), 3), queries=1, heads=3, topk=3,
              note="a one-token context: fewer keys than top-k"),
            P("mtp_n2_bs17", Paging((1, 18, 40), 17), queries=2, heads=17, topk=17,
              note="MTP: query i sees [0, ctx - N + i + 1); ctx 1 < N leaves query 0 nothing"),
            P("mtp_n3_bs129", Paging((129, 130), 129), queries=3, heads=3, topk=129),
            P("empty_contexts", Paging((0, 0), 3), queries=2, heads=3, topk=3, note="every row -1"),
            P("max_table_fill", Paging((51, 51), 17, extra_blocks=0), queries=2, heads=3, topk=129,
              note="context_lens == max_blocks * block_size"),
            P("table_garbage_padding", Paging((20, 4, 35), 17, extra_blocks=2, padding="garbage"),
              queries=1, heads=3, topk=17, note="block-table entries past the used blocks are not ids"),
            P("shared_prefix", Paging((40, 45), 17, share_prefix=2), queries=1, heads=3, topk=17,
              note="two sequences read the same physical prefix blocks"),
            P("topk_exceeds_context", Paging((5, 16), 3), queries=1, heads=3, topk=129),
            P("empty_batch", Paging((), 3), queries=1, heads=3, topk=3),
            P("fp8_cache", Paging((1, 18, 40), 17), queries=2, heads=17, topk=17, keys="fp8"),
            P("noncontig_views", Paging((20, 40), 17), queries=2, heads=3, topk=33, view=True,
              outcome=RESULT_OR_ERROR, note="q, weights and the block table (a column slice) are views"),
            P("model_weights_bs16", Paging((1, 18, 40), 16), queries=2, heads=17, topk=17, model_weights=True,
              note="weights from a q-dtype weights_proj; block size 16 (vendor paged caches)"),
        ]
    return [
        P("decode_b2_ctx1500_5000", Paging((1500, 5000), BLOCK_GLM5), 1, HI_GLM5, TOPK_GLM5,
          note="one context shorter than top-k (-1 padded)"),
        P("mtp_n2_ctx2049_4097", Paging((2049, 4097), BLOCK_GLM5), 2, HI_GLM5, TOPK_GLM5,
          note="query 0 of the first sequence sees exactly top-k keys"),
        P("fp8_cache_mtp_n2", Paging((2049, 4097), BLOCK_GLM5), 2, HI_GLM5, TOPK_GLM5, keys="fp8",
          note="the FP8 key cache indexer_k_cache_write fills"),
    ]


def _paging_errors(preset: str):
    """(name, paging, table edit, note): layouts the contract rejects."""
    if preset != "tiny":
        return []
    def beyond(table, lens):
        lens[1] = table.shape[1] * 3 + 1
    def minus_one(table, lens):
        table[1, 0] = -1
    def too_big(table, lens):
        table[0, 1] = 10 ** 6
    def negative(table, lens):
        lens[0] = -1
    return [("context_beyond_capacity", beyond, "context_lens > max_blocks * block_size"),
            ("minus_one_block_in_use", minus_one, "-1 among the blocks holding [0, context_lens)"),
            ("block_id_out_of_range", too_big, "a block id >= num_blocks in the used range"),
            ("negative_context_len", negative, "context_lens < 0")]


ERROR_PAGING = Paging((4, 7), 3)


@generator("indexer_topk_paged")
def indexer_topk_paged_cases(preset: str):
    check = {"out": TopKSet(scores=paged_indexer_scores, tau=TAU)}
    for dtype in FLOATS:
        for spec in _paged_indexer_specs(preset):
            yield Case("indexer_topk_paged", preset, spec.name, dtype,
                       lambda g, spec=spec, dtype=dtype: _paged_indexer_args(g, spec, dtype),
                       check, outcome=spec.outcome, note=spec.note)
        for name, edit, note in _paging_errors(preset):
            spec = PagedIndexerSpec(name, ERROR_PAGING, queries=1, heads=3, topk=3)
            def inputs(g, spec=spec, dtype=dtype, edit=edit):
                q, cache, w, table, lens, topk = _paged_indexer_args(g, spec, dtype)
                edit(table, lens)
                return q, cache, w, table, lens, topk
            yield Case("indexer_topk_paged", preset, name, dtype, inputs, outcome=ERROR, note=note)


# -- sparse MLA attention --------------------------------------------------------------------
def _pick(g, low: int, high: int, count: int) -> list[int]:
    """`count` distinct positions drawn from [low, high)."""
    return (torch.randperm(high - low, generator=g)[:count] + low).tolist()


def _row(valid: list[int], topk: int) -> list[int]:
    return valid + [-1] * (topk - len(valid))


@dataclasses.dataclass(frozen=True)
class SparseSpec:
    """Queries at causal `positions` of one sequence of `num_keys` rows; each selects
    min(topk, position + 1) distinct earlier rows, left-packed, -1 padded.

    invalid: also scatter -1 and >= S entries through the rows (no longer left-packed).
    dead_rows: queries whose every entry is invalid (out 0, lse -inf).
    duplicates: repeat some selected rows inside a row (each occurrence counts).
    q_scale: > 1 makes the softmax peaked (scores far beyond exp's fp32 range unless the
        maximum is subtracted).
    """
    name: str
    positions: tuple[int, ...]
    num_keys: int
    heads: int
    topk: int
    d_qk: int = D_QK
    d_v: int = D_V
    invalid: bool = False
    dead_rows: tuple[int, ...] = ()
    duplicates: bool = False
    q_scale: float = 1.0
    view: bool = False
    outcome: str = RESULT
    note: str = ""


def _sparse_indices(g, positions, num_keys, topk, *, invalid=False, dead_rows=(), duplicates=False):
    rows = []
    for i, p in enumerate(positions):
        visible = min(p + 1, num_keys)
        valid = _pick(g, 0, visible, min(topk, visible))
        if i in dead_rows:
            valid = []
        if duplicates and len(valid) >= 2:
            repeats = max(1, len(valid) // 3)
            valid = valid[:len(valid) - repeats] + valid[:repeats]
        row = _row(valid, topk)
        if invalid and topk >= 3:
            junk = [-1, num_keys, num_keys + 5, 2 ** 31 - 1]
            spots = _pick(g, 0, topk, max(1, topk // 4))
            for j, spot in enumerate(spots):
                row[spot] = junk[j % len(junk)]
        if i in dead_rows and topk >= 2:
            row[-1] = num_keys          # >= S: invalid too
        rows.append(row)
    return torch.tensor(rows, dtype=I32).reshape(len(positions), topk)


def _sparse_args(g, spec: SparseSpec, dtype):
    t, h = len(spec.positions), spec.heads
    idx = _sparse_indices(g, spec.positions, spec.num_keys, spec.topk, invalid=spec.invalid,
                          dead_rows=spec.dead_rows, duplicates=spec.duplicates)
    if spec.view:
        q = View(randn(g, (h, t, spec.d_qk), dtype), lambda b: b.transpose(0, 1))
        kv = View(randn(g, (spec.num_keys, spec.d_qk + 80), dtype), lambda b, d=spec.d_qk: b[:, :d])
        idx = View(torch.cat([idx, torch.full_like(idx, -1)], dim=1), lambda b, k=spec.topk: b[:, :k])
        return q, kv, idx, GLM5_SM_SCALE, spec.d_v
    q = randn(g, (t, h, spec.d_qk), dtype, spec.q_scale)
    kv = randn(g, (spec.num_keys, spec.d_qk), dtype)
    return q, kv, idx, GLM5_SM_SCALE, spec.d_v


def _sparse_specs(preset: str) -> list[SparseSpec]:
    S = SparseSpec
    if preset == "tiny":
        return [
            S("t1_h1_keys1_topk1", (0,), 1, heads=1, topk=1),
            S("t3_h3_keys17_topk3", (16, 5, 16), 17, heads=3, topk=3),
            S("t17_h17_keys129_topk17", tuple(range(0, 129, 8)), 129, heads=17, topk=17,
              note="early queries see fewer rows than top-k (-1 padded)"),
            S("t3_h3_keys40_topk129", (0, 20, 39), 40, heads=3, topk=129, note="top-k > S"),
            S("invalid_entries", (16, 40, 128), 129, heads=3, topk=17, invalid=True,
              note="-1, S, S+5 and 2^31-1 scattered through the rows: ignored"),
            S("all_invalid_rows", (3, 30, 50), 129, heads=17, topk=17, dead_rows=(0, 2),
              note="rows without a valid entry: out 0, lse -inf"),
            S("duplicate_indices", (16, 100, 128), 129, heads=3, topk=17, duplicates=True,
              note="a repeated index counts once per occurrence"),
            S("empty_batch", (), 17, heads=3, topk=3),
            S("small_head_dims", (16, 10, 3), 17, heads=3, topk=17, d_qk=65, d_v=33,
              note="d_qk and d_v other than 576 / 512"),
            S("peaked_softmax", (16, 40, 128), 129, heads=3, topk=17, q_scale=30.0,
              note="scores ~ 100s: the row maximum must be subtracted before exp"),
            S("noncontig_views", (16, 40, 128), 129, heads=3, topk=17, view=True, outcome=RESULT_OR_ERROR,
              note="q (heads-major), kv (column slice) and indices (column slice) are views"),
        ]
    return [
        S("prefill_keys4096", (100, 2047, 4095), 4096, H_GLM5, TOPK_GLM5,
          note="queries see 101 (-1 padded), exactly 2048, and 4096 rows"),
        S("prefill_invalid_duplicates", (3000, 4095), 4096, H_GLM5, TOPK_GLM5, invalid=True,
          duplicates=True),
    ]


D_QK_TINY, D_V_TINY = 40, 32


def _sparse_with(g, d, *, kv_dtype=None, kv_width=D_QK_TINY, rows=3, index_dtype=I32, sm_scale=GLM5_SM_SCALE,
                 d_v=D_V_TINY):
    """Arguments of a small sparse_mla_attention call (3 queries, 2 heads, 17 kv rows, top-4),
    with one thing changed."""
    q = randn(g, (3, 2, D_QK_TINY), d)
    kv = randn(g, (17, kv_width), kv_dtype or d)
    indices = torch.randint(0, 17, (rows, 4), generator=g, dtype=torch.int64).to(index_dtype)
    return q, kv, indices, sm_scale, d_v


_SPARSE_ERRORS = (
    ("kv_dtype_differs", lambda g, d: _sparse_with(
        g, d, kv_dtype=torch.float32 if d != torch.float32 else torch.bfloat16), "kv", "kv in another dtype than q"),
    ("kv_width_differs", lambda g, d: _sparse_with(g, d, kv_width=D_QK_TINY + 1), "kv", "kv rows of Dqk + 1"),
    ("index_rows_differ", lambda g, d: _sparse_with(g, d, rows=2), "indices", "2 index rows for 3 queries"),
    ("int64_indices", lambda g, d: _sparse_with(g, d, index_dtype=torch.int64), "indices", "indices are int32"),
    ("d_v_beyond_d_qk", lambda g, d: _sparse_with(g, d, d_v=D_QK_TINY + 1), "d_v", "d_v > Dqk"),
    ("zero_sm_scale", lambda g, d: _sparse_with(g, d, sm_scale=0.0), "sm_scale", "sm_scale must be > 0"),
    ("infinite_sm_scale", lambda g, d: _sparse_with(g, d, sm_scale=math.inf), "sm_scale", "sm_scale must be finite"),
)


@generator("sparse_mla_attention")
def sparse_mla_attention_cases(preset: str):
    for dtype in FLOATS:
        for spec in _sparse_specs(preset):
            yield Case("sparse_mla_attention", preset, spec.name, dtype,
                       lambda g, spec=spec, dtype=dtype: _sparse_args(g, spec, dtype),
                       _attention_checks("sparse_mla_attention", dtype, spec.q_scale > 1), outcome=spec.outcome,
                       note=spec.note)
        if preset == "tiny":
            yield from expected_errors("sparse_mla_attention", preset, dtype, _SPARSE_ERRORS)


# -- paged MLA decode ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Decode of N queries per sequence over a paged latent cache.

    For the sparse op, query i of sequence b selects min(topk, visible) distinct positions
    of its visible range [0, ctx - N + i + 1); `invalid` adds -1 and stale positions
    (>= ctx, some inside the last block, whose slots hold poison); `dead_rows` makes every
    entry of those (b, i) invalid; `duplicates` repeats selected positions."""
    name: str
    paging: Paging
    queries: int
    heads: int
    topk: int = 0
    d_qk: int = D_QK
    d_v: int = D_V
    invalid: bool = False
    dead_rows: tuple[tuple[int, int], ...] = ()
    duplicates: bool = False
    q_scale: float = 1.0
    view: bool = False
    outcome: str = RESULT
    note: str = ""


def _decode_indices(g, spec: DecodeSpec, capacity: int) -> torch.Tensor:
    rows = []
    for b, ctx in enumerate(spec.paging.contexts):
        for i in range(spec.queries):
            visible = max(0, ctx - spec.queries + i + 1)
            valid = [] if (b, i) in spec.dead_rows else _pick(g, 0, visible, min(spec.topk, visible))
            if spec.duplicates and len(valid) >= 2:
                repeats = max(1, len(valid) // 3)
                valid = valid[:len(valid) - repeats] + valid[:repeats]
            row = _row(valid, spec.topk)
            stale = [p for p in (ctx, ctx + 1, capacity - 1) if ctx <= p < capacity]
            if (spec.invalid or (b, i) in spec.dead_rows) and spec.topk >= 3:
                junk = [-1, *stale, capacity + 3, 2 ** 31 - 1]
                spots = _pick(g, 0, spec.topk, max(1, spec.topk // 4))
                for j, spot in enumerate(spots):
                    row[spot] = junk[j % len(junk)]
            rows.append(row)
    return torch.tensor(rows, dtype=I32).reshape(len(spec.paging.contexts), spec.queries, spec.topk)


def _decode_args(g, spec: DecodeSpec, dtype, sparse: bool):
    p = spec.paging
    num_blocks, table, lens, owned = p.layout(g)
    b, n, h = len(p.contexts), spec.queries, spec.heads
    cache = _paged_rows(g, num_blocks, p.block_size, spec.d_qk, dtype, owned)
    tail = (GLM5_SM_SCALE, spec.d_v)
    if sparse:
        idx = _decode_indices(g, spec, table.shape[1] * p.block_size)
    if spec.view:
        q = View(randn(g, (b, h, n, spec.d_qk), dtype), lambda t: t.transpose(1, 2))
        wide = torch.cat([table, torch.full_like(table, -1)], dim=1)
        table = View(wide, lambda t, m=table.shape[1]: t[:, :m])
        if sparse:
            idx = View(torch.cat([idx, torch.full_like(idx, -1)], dim=2), lambda t, k=spec.topk: t[..., :k])
    else:
        q = randn(g, (b, n, h, spec.d_qk), dtype, spec.q_scale)
    return (q, cache, table, lens, idx, *tail) if sparse else (q, cache, table, lens, *tail)


def _decode_specs(preset: str, sparse: bool) -> list[DecodeSpec]:
    D = DecodeSpec
    k = lambda topk: topk if sparse else 0
    if preset == "tiny":
        specs = [
            D("b1_n1_bs1", Paging((3,), 1), 1, heads=1, topk=k(1)),
            D("b3_n1_bs3", Paging((1, 17, 7), 3), 1, heads=3, topk=k(3)),
            D("mtp_n2_bs17", Paging((1, 18, 40), 17), 2, heads=17, topk=k(17),
              note="MTP: ctx 1 < N leaves query 0 of sequence 0 nothing"),
            D("mtp_n3_bs129", Paging((1, 129, 130), 129), 3, heads=3, topk=k(129)),
            D("empty_contexts", Paging((0, 0), 3), 2, heads=3, topk=k(3), note="out 0, lse -inf"),
            D("max_table_fill", Paging((51, 51), 17, extra_blocks=0), 2, heads=3, topk=k(17),
              note="context_lens == max_blocks * block_size"),
            D("table_garbage_padding", Paging((20, 4, 35), 17, extra_blocks=2, padding="garbage"), 1,
              heads=3, topk=k(17), note="block-table entries past the used blocks are not ids"),
            D("shared_prefix", Paging((40, 45), 17, share_prefix=2), 2, heads=3, topk=k(17)),
            D("peaked_softmax", Paging((20, 40), 17), 1, heads=3, topk=k(17), q_scale=30.0,
              note="scores ~ 100s: the row maximum must be subtracted before exp"),
            D("small_head_dims", Paging((20, 40), 17), 2, heads=3, topk=k(17), d_qk=65, d_v=33),
            D("empty_batch", Paging((), 3), 1, heads=3, topk=k(3)),
            D("noncontig_views", Paging((20, 40), 17), 2, heads=3, topk=k(17), view=True,
              outcome=RESULT_OR_ERROR, note="q (heads-major) and the block table (a column slice) are views"),
        ]
        if sparse:
            specs += [
                D("invalid_and_stale_entries", Paging((20, 40), 17), 2, heads=3, topk=17, invalid=True,
                  note="-1 and positions >= context_lens (poisoned slots of the last block): ignored"),
                D("all_invalid_rows", Paging((20, 40), 17), 2, heads=17, topk=17, dead_rows=((0, 1), (1, 0)),
                  note="rows without a valid entry: out 0, lse -inf"),
                D("duplicate_indices", Paging((20, 40), 17), 2, heads=3, topk=17, duplicates=True),
                D("topk_exceeds_context", Paging((5, 16), 3), 1, heads=3, topk=129),
            ]
        return specs
    if sparse:
        return [
            D("decode_b2_ctx1000_3000", Paging((1000, 3000), BLOCK_GLM5), 1, H_GLM5, TOPK_GLM5,
              note="one context shorter than top-k (-1 padded)"),
            D("mtp_n2_ctx2049_3000", Paging((2049, 3000), BLOCK_GLM5), 2, H_GLM5, TOPK_GLM5,
              invalid=True, note="MTP with stale and -1 entries; query 0 of sequence 0 sees exactly 2048"),
        ]
    return [
        D("decode_b2_ctx129_1000", Paging((129, 1000), BLOCK_GLM5), 1, H_GLM5),
        D("mtp_n2_ctx1_700", Paging((1, 700), BLOCK_GLM5), 2, H_GLM5,
          note="MTP: ctx 1 < N leaves query 0 of sequence 0 nothing"),
    ]


def _decode_cases(op: str, preset: str, sparse: bool):
    for dtype in FLOATS:
        for spec in _decode_specs(preset, sparse):
            yield Case(op, preset, spec.name, dtype,
                       lambda g, spec=spec, dtype=dtype: _decode_args(g, spec, dtype, sparse),
                       _attention_checks(op, dtype, spec.q_scale > 1), outcome=spec.outcome, note=spec.note)
        for name, edit, note in _paging_errors(preset):
            spec = DecodeSpec(name, ERROR_PAGING, 1, heads=3, topk=3 if sparse else 0)
            def inputs(g, spec=spec, dtype=dtype, edit=edit):
                args = _decode_args(g, spec, dtype, sparse)
                edit(args[2], args[3])
                return args
            yield Case(op, preset, name, dtype, inputs, outcome=ERROR, note=note)


@generator("sparse_mla_decode_paged")
def sparse_mla_decode_paged_cases(preset: str):
    yield from _decode_cases("sparse_mla_decode_paged", preset, sparse=True)


@generator("dense_mla_decode_paged")
def dense_mla_decode_paged_cases(preset: str):
    yield from _decode_cases("dense_mla_decode_paged", preset, sparse=False)
