"""Adapters from glm5_hal's canonical ops to torch_mlu_ops (`tmo`) and the backend's BANG C
kernels.

`declare(backend)` registers one closure per op on a CambriconBackend instance; each reaches
the vendor through `backend.runtime.tmo` (the real torch_mlu_ops, or an emulator in tests),
so several instances coexist. Inputs arrive validated by glm5_hal.ops; an adapter converts
layouts and index conventions (tmo's paged caches are [blocks, heads, block_size, dim];
the contract's are [blocks, block_size, dim], i.e. one head), calls the vendor op and
returns exactly the canonical outputs. Each `supports()` checks the documented per-call
constraints of the tmo op and returns a reason when a call falls outside them, so dispatch
moves on instead of the vendor op failing on the device. Semantics follow the torch_mlu_ops
1.12 docstrings ("Math:" sections), summarised in README.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from glm5_hal.vendor_backend import Verdict, dtype_name, first_reason

if TYPE_CHECKING:
    from . import CambriconBackend

_F32, _F16, _BF16, _I8, _I32, _I64 = (torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                      torch.int32, torch.int64)
_FP8 = torch.float8_e4m3fn
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

# -- vendor constraints (torch_mlu_ops 1.12 docstrings; see README.md) ------------------------
ROTARY_MAX_HEAD_SIZE = 256            # apply_rotary: head_size in [2, 256]
INDEXER_HEADS = (32, 64)              # masked_indexer_select_paged_kv: head_num 32 or 64
INDEXER_DIM = 128                     # ... head_size 128
INT32_MAX = 2**31 - 1                 # slot_mapping / indices are int32
FP8_MAX, FP8_MIN_AMAX = 448.0, 1e-4   # the fp8 rule of the contract (OPS.md section 3)
DECODE_MAX_DQK, DECODE_MAX_HEADS = 1024, 128  # csrc/glm5_hal_cambricon.h (NRAM tiling)
#: Below this logit sigmoid(x) < 2e-35: float32 scores head for underflow, and a row whose
#: selected scores are all 0 renormalises to 0/0 in the vendor op (the contract adds 1e-20).
SIGMOID_MIN_LOGIT = -80.0

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "tmo.fused_rms_norm": "gamma in x's dtype (an fp32 x takes any weight exactly)",
    "tmo.apply_rotary": f"head_size <= {ROTARY_MAX_HEAD_SIZE}; run in float32 with float64-derived sin/cos",
    "tmo.moe_softmax_topk": "a group is scored by its best expert: grouped softmax routing is declined",
    "tmo.moe_sigmoid_topk": f"renormalises by a plain sum: logits below {SIGMOID_MIN_LOGIT:g} are declined",
    "tmo.moe_gen_idx": "expert ids must lie in [0, expert_num): dropped ids go to one extra expert",
    "tmo.group_gemm": "float32 only while torch.backends.mlu.matmul.fp32_precision is not tf32",
    "tmo.moe_combine_result": "one row per (token, slot): repeated src entries are declined",
    "tmo.reshape_paged_cache": "int32 slots (caches up to 2^31-1 slots); FP8 rows copied as bytes",
    "tmo.reshape_from_cache": "contiguous caches only",
    "tmo.quant_to_paged_cache": "FP8 MLUs only; no ue8m0 scales; rows with amax < 1e-4 declined "
                                "(no scale floor in the vendor op)",
    "tmo.masked_indexer_select_paged_kv": f"head_size {INDEXER_DIM}, <= {INDEXER_HEADS[-1]} heads "
                                          f"(zero-padded to {INDEXER_HEADS}), bf16/fp16, every "
                                          "context_len >= N, no FP8 keys with a bf16 query",
    "sparse_mla_decode_paged (BANG C)": f"Dqk <= {DECODE_MAX_DQK}, H <= {DECODE_MAX_HEADS}",
}


def declare(backend: "CambriconBackend") -> None:
    """Declares every adapter on `backend` (closures over it: one set per instance)."""
    for family in (_declare_common, _declare_moe, _declare_kv, _declare_dsa):
        family(backend)


def sigmoid_underflow(logits: Tensor, kernel: str) -> str | None:
    """The reason to decline a renormalised sigmoid routing whose float32 scores may be 0."""
    if logits.numel() and bool(logits.min() < SIGMOID_MIN_LOGIT):
        return (f"logits below {SIGMOID_MIN_LOGIT:g}: their float32 sigmoid scores underflow, and {kernel} "
                "renormalises by a plain sum (0/0 is NaN; the contract adds 1e-20)")
    return None


# -- shared conversions ------------------------------------------------------------------------
def rotary_tables(positions: Tensor, rot: int, theta: float, interleaved: bool,
                  device: torch.device) -> tuple[Tensor, Tensor]:
    """float32 [T, rot] sin and cos tables, one row per token (row t for positions[t]),
    laid out as tmo.apply_rotary reads them: each angle repeated over its pair for the
    interleaved mode, the two halves for the folded one. Angles are formed in float64 on the
    host: MLUs have no float64, and a float32 angle of a large position is off by more than
    the float32 tolerance of the op."""
    exponents = torch.arange(rot // 2, dtype=torch.float64) * (-2.0 / rot)
    angles = positions.to("cpu", torch.float64)[:, None] * torch.pow(float(theta), exponents)[None, :]
    sin, cos = angles.sin().to(_F32), angles.cos().to(_F32)
    if interleaved:
        sin, cos = sin.repeat_interleave(2, dim=-1), cos.repeat_interleave(2, dim=-1)
    else:
        sin, cos = torch.cat((sin, sin), dim=-1), torch.cat((cos, cos), dim=-1)
    return sin.to(device), cos.to(device)


def contract_order(src: Tensor, tokens_per_expert: Tensor, slots: int) -> Tensor | None:
    """The permutation putting expert-grouped rows into the contract's order (ascending flat
    index within each expert), or None when they already are. tmo documents the grouping by
    expert but not the order inside a group."""
    rows = src.shape[0]
    if rows < 2:
        return None
    experts = torch.arange(tokens_per_expert.shape[0], device=src.device)
    expert_of_row = torch.repeat_interleave(experts, tokens_per_expert.long(), output_size=rows)
    key = expert_of_row * slots + src.long()
    if bool((key[1:] > key[:-1]).all()):
        return None
    return torch.argsort(key)


def scatter_to_slots(y: Tensor, src: Tensor, slots: int) -> Tensor:
    """[slots, D]: row src[r] holds y[r], slots without a row hold 0 (tmo's combine reads one
    row per (token, slot) pair in flat order)."""
    out = y.new_zeros(slots, y.shape[1])
    out[src.long()] = y
    return out


def repeated_slot(src: Tensor, slots: int) -> str | None:
    if src.numel() < 2:
        return None
    counts = torch.bincount(src.long(), minlength=slots)
    if bool((counts > 1).any()):
        return "src repeats a (token, slot) index; tmo.moe_combine_result combines one row per pair"
    return None


def pad_heads(t: Tensor, heads: int, dim: int) -> Tensor:
    """`t` with dim `dim` zero-padded to `heads`, contiguous."""
    if t.shape[dim] == heads:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = heads
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _as_bytes(t: Tensor) -> Tensor:
    """FP8 tensors as their int8 bytes: tmo's copy ops list int8 but not float8 (a copy is
    exact either way)."""
    return t.view(_I8) if t.dtype == _FP8 else t


# -- common ------------------------------------------------------------------------------------
def _declare_common(backend: "CambriconBackend") -> None:
    def rms_norm_supported(x: Tensor, weight: Tensor, eps: float) -> Verdict:
        if weight.dtype == x.dtype or x.dtype == _F32:
            return True
        return (f"tmo.fused_rms_norm takes gamma in x's dtype; casting the {dtype_name(weight.dtype)} weight "
                f"to {dtype_name(x.dtype)} would round it")

    @backend.impl("rms_norm", dtypes=FLOATS, supports=rms_norm_supported)
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.numel() == 0:
            return torch.empty_like(x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        gamma = weight.to(x.dtype).contiguous()
        out = backend.runtime.tmo.fused_rms_norm(rows, None, gamma, None, None, float(eps), False)
        return out.view(x.shape)

    @backend.impl("silu_and_mul", dtypes=FLOATS)
    def silu_and_mul(x: Tensor) -> Tensor:
        out_shape = (*x.shape[:-1], x.shape[-1] // 2)
        if x.numel() == 0:
            return x.new_empty(out_shape)
        # tmo.active with is_gated: act(x[..., :C//2]) * x[..., C//2:] -- the contract's [gate, up]
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return backend.runtime.tmo.active(rows, "silu", True).view(out_shape)

    def rope_supported(x: Tensor, positions: Tensor, theta: float, interleaved: bool) -> Verdict:
        if x.shape[2] > ROTARY_MAX_HEAD_SIZE:
            return f"tmo.apply_rotary takes head_size <= {ROTARY_MAX_HEAD_SIZE}, got a rotary dim of {x.shape[2]}"
        return True

    @backend.impl("apply_rope", dtypes=FLOATS, supports=rope_supported)
    def apply_rope(x: Tensor, positions: Tensor, theta: float, interleaved: bool) -> Tensor:
        tokens, _, rot = x.shape
        if x.numel() == 0:
            return torch.empty_like(x)
        sin, cos = rotary_tables(positions, rot, theta, interleaved, x.device)
        # One table row per token, so position_ids is simply 0..T-1 (discrete mode) and any
        # position, negative ones included (the backward rotates by -positions), works.
        row_ids = torch.arange(tokens, dtype=_I32, device=x.device)
        cu_seqlens = torch.tensor([0, tokens], dtype=_I32, device=x.device)
        xf = x.to(_F32).contiguous()
        out = torch.empty_like(xf)
        backend.runtime.tmo.apply_rotary(xf, sin, cos, row_ids, cu_seqlens, interleaved, True, False, tokens,
                                         output=out)
        return out.to(x.dtype)


# -- MoE ---------------------------------------------------------------------------------------
def _declare_moe(backend: "CambriconBackend") -> None:
    def route_supported(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
                        score_func) -> Verdict:
        if score_func == "softmax" and n_group > 1:
            return ("tmo.moe_softmax_topk scores an expert group by its best expert (the contract: by its "
                    "best two) and masks dropped groups with 0, not -inf")
        if score_func == "sigmoid" and norm_topk_prob:
            return first_reason(lambda: sigmoid_underflow(logits, "tmo.moe_sigmoid_topk"))
        return True

    @backend.impl("moe_route", dtypes=FLOATS, supports=route_supported)
    def moe_route(logits: Tensor, bias: Tensor | None, top_k: int, n_group: int, topk_group: int,
                  routed_scaling_factor: float, norm_topk_prob: bool, score_func: str) -> tuple[Tensor, Tensor]:
        tokens, experts = logits.shape
        if tokens == 0:
            return (logits.new_empty((0, top_k), dtype=_F32), logits.new_empty((0, top_k), dtype=_I32))
        tmo = backend.runtime.tmo
        scores = logits.contiguous()
        if score_func == "sigmoid":
            # Grouped sigmoid routing scores a group by its best two only when a score_bias is
            # given (its best one otherwise): a zero bias selects the contract's rule exactly.
            if bias is None and n_group > 1:
                bias = logits.new_zeros(experts, dtype=_F32)
            weights, ids = tmo.moe_sigmoid_topk(
                scores, top_k, normalize=norm_topk_prob, num_expert_group=n_group, topk_group=topk_group,
                normed_by="topk_logit", route_scale=float(routed_scaling_factor), score_bias=bias)
        else:
            weights, ids = tmo.moe_softmax_topk(
                scores, top_k, normalize=norm_topk_prob, num_expert_group=n_group, topk_group=topk_group,
                normed_by="topk_logit", route_scale=float(routed_scaling_factor), score_bias=bias)
        return weights, ids.to(_I32)

    @backend.impl("moe_permute", dtypes=FLOATS)
    def moe_permute(x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        tokens, k = ids.shape
        slots = tokens * k
        if slots == 0:
            return (x.new_empty((0, x.shape[1])), ids.new_zeros(num_experts, dtype=_I32),
                    ids.new_empty(0, dtype=_I32))
        tmo = backend.runtime.tmo
        # moe_gen_idx wants every id in [0, expert_num): ids the contract drops (-1, other
        # ranks' experts) become one extra expert after the real ones, whose rows
        # moe_expand_input's [start_expert_id, start_expert_id + expert_size) range leaves out.
        dropped = (ids < 0) | (ids >= num_experts)
        expert_num = num_experts + 1 if bool(dropped.any()) else num_experts
        expert_id = torch.where(dropped, num_experts, ids).to(_I32).contiguous()
        expand_idx, combine_idx, token_count, cusum = tmo.moe_gen_idx(expert_id, expert_num)[:4]
        rows = int(cusum[num_experts])
        x_perm = tmo.moe_expand_input(x.contiguous(), expand_idx, cusum, 0, num_experts)[:rows]
        # combine_idx maps flat slot -> row; the contract's src is its inverse.
        src = torch.empty(slots, dtype=_I32, device=ids.device)
        src[combine_idx.long()] = torch.arange(slots, dtype=_I32, device=ids.device)
        src = src[:rows]
        tokens_per_expert = token_count[:num_experts].to(_I32)
        order = contract_order(src, tokens_per_expert, slots)
        if order is not None:
            x_perm, src = x_perm[order], src[order]
        return x_perm, tokens_per_expert, src

    def unpermute_supported(y: Tensor, src: Tensor, weights: Tensor) -> Verdict:
        return first_reason(lambda: repeated_slot(src, weights.shape[0] * weights.shape[1]))

    @backend.impl("moe_unpermute", dtypes=FLOATS, supports=unpermute_supported)
    def moe_unpermute(y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
        tokens, k = weights.shape
        if tokens == 0:
            return y.new_zeros((0, y.shape[1]))
        slots = tokens * k
        gather_ids = torch.arange(slots, dtype=_I32, device=y.device)
        return backend.runtime.tmo.moe_combine_result(
            scatter_to_slots(y, src, slots), weights.contiguous(), gather_ids, None, None, 0, 0)

    def grouped_gemm_supported(x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Verdict:
        if x.dtype == _F32 and _tf32_enabled(backend.runtime.backends):
            return ("tmo.group_gemm would run this float32 GEMM in TF32 "
                    "(torch.backends.mlu.matmul.fp32_precision is 'tf32')")
        return True

    @backend.impl("grouped_gemm", dtypes=FLOATS, supports=grouped_gemm_supported)
    def grouped_gemm(x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
        if x.shape[0] == 0 or w.shape[1] == 0:
            return x.new_zeros((x.shape[0], w.shape[1]))
        # max_in_group_list only has to bound the counts: the row count does, without a sync.
        return backend.runtime.tmo.group_gemm(x.contiguous(), w.contiguous(), tokens_per_expert.contiguous(),
                                              None, None, None, None, x.shape[0])


def _tf32_enabled(backends) -> bool:
    """torch_mlu_ops' own rule for letting a float32 group_gemm use TF32."""
    mlu = getattr(backends, "mlu", None)
    precision = getattr(getattr(mlu, "matmul", None), "fp32_precision", "none")
    return precision == "tf32" or (precision == "none" and getattr(backends, "fp32_precision", "") == "tf32")


# -- KV cache ----------------------------------------------------------------------------------
def _declare_kv(backend: "CambriconBackend") -> None:
    def kv_write_supported(cache: Tensor, values: Tensor, slot_mapping: Tensor) -> Verdict:
        if cache.shape[0] * cache.shape[1] > INT32_MAX:
            return "tmo.reshape_paged_cache takes int32 slots; this cache has more than 2^31-1"
        return True

    @backend.impl("kv_cache_write", dtypes=FLOATS + (_FP8,), supports=kv_write_supported)
    def kv_cache_write(cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
        tokens, dim = values.shape
        if tokens == 0:
            return None
        blocks, block_size = cache.shape[0], cache.shape[1]
        # [T, 1, D] into [blocks, 1, block_size, D]: the contract's cache is tmo's with one head.
        backend.runtime.tmo.reshape_paged_cache(
            _as_bytes(values).reshape(tokens, 1, dim).contiguous(), None,
            _as_bytes(cache).view(blocks, 1, block_size, dim), None, slot_mapping.to(_I32).contiguous())
        return None

    def gather_supported(cache: Tensor, block_table: Tensor, context_lens: Tensor) -> Verdict:
        if not cache.is_contiguous():
            return ("tmo.reshape_from_cache reads a contiguous paged cache; this one is a strided view "
                    "(copying it would cost a whole-cache copy per call)")
        return True

    @backend.impl("kv_cache_gather", dtypes=FLOATS + (_FP8,), supports=gather_supported)
    def kv_cache_gather(cache: Tensor, block_table: Tensor, context_lens: Tensor) -> Tensor:
        blocks, block_size, dim = cache.shape
        total = int(context_lens.sum()) if context_lens.numel() else 0
        out = cache.new_empty((total, dim))
        if total == 0:
            return out
        backend.runtime.tmo.reshape_from_cache(
            _as_bytes(out).view(total, 1, dim), None, _as_bytes(cache).view(blocks, 1, block_size, dim), None,
            context_lens.contiguous(), int(context_lens.max()), None, block_table.contiguous(), None)
        return out

    def indexer_k_write_supported(k: Tensor, k_cache: Tensor, k_scale: Tensor, slot_mapping: Tensor,
                                  scale_fmt: str | None) -> Verdict:
        def small_rows() -> str | None:
            written = k[slot_mapping >= 0]
            if written.numel() and bool((written.abs().amax(dim=-1) < FP8_MIN_AMAX).any()):
                return (f"a row's amax is below {FP8_MIN_AMAX:g}: tmo.quant_to_paged_cache scales by amax/448 "
                        f"with no floor, the contract by max(amax, {FP8_MIN_AMAX:g})/448")
            return None
        return first_reason(
            backend.fp8_declined,
            lambda: None if scale_fmt is None else
            f"tmo.quant_to_paged_cache writes plain amax/448 scales, not scale_fmt={scale_fmt!r}",
            small_rows)

    @backend.impl("indexer_k_cache_write", dtypes=FLOATS, supports=indexer_k_write_supported)
    def indexer_k_cache_write(k: Tensor, k_cache: Tensor, k_scale: Tensor, slot_mapping: Tensor,
                              scale_fmt: str | None) -> None:
        written = slot_mapping >= 0
        # Padding rows are dropped here: the docstring of quant_to_paged_cache (unlike
        # reshape_paged_cache's) does not say it skips negative slots.
        keys, slots = k[written].contiguous(), slot_mapping[written].to(_I32).contiguous()
        if keys.shape[0] == 0:
            return None
        blocks, block_size, dim = k_cache.shape
        backend.runtime.tmo.quant_to_paged_cache(
            keys.view(-1, 1, dim), None, k_cache.view(blocks, 1, block_size, dim), None,
            k_scale.view(blocks, 1, block_size), None, slots)
        return None


# -- DSA ---------------------------------------------------------------------------------------
def _declare_dsa(backend: "CambriconBackend") -> None:
    def indexer_paged_supported(q, k_cache, weights, block_table, context_lens, topk) -> Verdict:
        if isinstance(k_cache, (tuple, list)):
            return ("FP8 keys: tmo.masked_indexer_select_paged_kv takes a quantised key cache together with a "
                    "quantised query (q_scale); quantising the bf16/fp16 query would change the scores")
        batch, queries, heads, dim = q.shape
        if dim != INDEXER_DIM:
            return f"tmo.masked_indexer_select_paged_kv needs head_size {INDEXER_DIM}, got {dim}"
        if heads > INDEXER_HEADS[-1]:
            return f"tmo.masked_indexer_select_paged_kv takes at most {INDEXER_HEADS[-1]} heads, got {heads}"
        if batch and bool((context_lens < queries).any()):
            return (f"tmo.masked_indexer_select_paged_kv needs every context_len >= N = {queries} (its causal "
                    "mask assumes the queries lie inside the context)")
        return True

    @backend.impl("indexer_topk_paged", dtypes=HALVES, supports=indexer_paged_supported)
    def indexer_topk_paged(q: Tensor, k_cache: Tensor, weights: Tensor, block_table: Tensor,
                           context_lens: Tensor, topk: int) -> Tensor:
        batch, queries, heads, dim = q.shape
        if batch == 0:
            return q.new_empty((0, queries, topk), dtype=_I32)
        padded = INDEXER_HEADS[0] if heads <= INDEXER_HEADS[0] else INDEXER_HEADS[1]
        # Extra heads get weight 0: relu(q.k) * 0 adds nothing to a logit.
        q_in = pad_heads(q, padded, dim=2)
        w_in = pad_heads(weights, padded, dim=2).unsqueeze(-1)
        blocks, block_size, _ = k_cache.shape
        # With kv_cache_block_size 1 the op returns kv_cache_block_table[selected]: a table of
        # 0..L-1 turns that into the logical positions the contract returns.
        longest = max(int(context_lens.max()), 1)
        positions = torch.arange(longest, dtype=_I32, device=q.device).expand(batch, longest).contiguous()
        selected, counts = backend.runtime.tmo.masked_indexer_select_paged_kv(
            q_in, k_cache.view(blocks, 1, block_size, dim), w_in, positions, None, None,
            context_lens.contiguous(), block_table.contiguous(), False, topk, 1, 1.0, is_score_float=True)
        valid = torch.arange(topk, device=q.device) < counts.view(batch, queries, 1)
        return torch.where(valid, selected, -1).to(_I32)

    def sparse_decode_supported(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v) -> Verdict:
        heads, dqk = q.shape[2], q.shape[3]
        return first_reason(
            backend.kernels.missing,
            lambda: None if dqk <= DECODE_MAX_DQK else
            f"the BANG C sparse decode kernel takes Dqk <= {DECODE_MAX_DQK}, got {dqk}",
            lambda: None if heads <= DECODE_MAX_HEADS else
            f"the BANG C sparse decode kernel takes H <= {DECODE_MAX_HEADS}, got {heads}",
            lambda: None if kv_cache.shape[0] * kv_cache.shape[1] <= INT32_MAX else
            "the BANG C sparse decode kernel addresses cache rows with int32")

    @backend.impl("sparse_mla_decode_paged", dtypes=FLOATS, supports=sparse_decode_supported)
    def sparse_mla_decode_paged(q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                                indices: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
        batch, queries, heads, _ = q.shape
        out = q.new_empty((batch, queries, heads, d_v))
        lse = q.new_empty((batch, queries, heads), dtype=_F32)
        if lse.numel() == 0:
            return out, lse
        backend.kernels.sparse_mla_decode_paged(
            q.contiguous(), kv_cache.contiguous(), block_table.contiguous(), context_lens.contiguous(),
            indices.contiguous(), out, lse, sm_scale, backend.runtime.current_queue(q.device))
        return out, lse
