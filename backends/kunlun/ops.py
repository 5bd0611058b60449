"""Adapters from glm5_hal's canonical ops to Kunlun's kernels: `kunlun_ops`, the vLLM-Kunlun
MoE kernels registered in `torch.ops._C`, `torch.ops.xspeedgate_ops`, and the backend's own
XPU C++ kernels.

`declare(backend)` registers one closure per op on a KunlunBackend instance; each reaches
the vendor through `backend.runtime` (the real modules, or an emulator in tests), so several
instances coexist. Inputs arrive validated by glm5_hal.ops; an adapter converts layouts
(Kunlun's paged caches are [blocks, heads, block_size, dim]; the contract's have one head)
and index conventions (moe_pre_sorted's slot -> row map), calls the vendor op and returns
exactly the canonical outputs. Each `supports()` checks the vendor's per-call limits and
declines with a reason instead of letting a kernel fail or, worse, return garbage (the MoE
kernels above 512 experts leave their outputs untouched). Semantics follow vLLM-Kunlun's
usage and its torch equivalents (vllm_kunlun/ops/_kunlun_ops.py, ops/moe/); README.md has
the table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import chips
from glm5_hal.vendor_backend import Verdict, first_reason

if TYPE_CHECKING:
    from . import KunlunBackend

_F32, _F16, _BF16, _I32, _I64 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64
_FP8 = torch.float8_e4m3fn
FLOATS = (_F32, _F16, _BF16)
INT32_MAX = 2**31 - 1
DECODE_MAX_DQK, DECODE_MAX_HEADS = 1024, 128  # csrc/glm5_hal_kunlun.h (local-memory tiling)
#: Below this logit sigmoid(x) < 2e-35: float32 scores head for underflow, and a row whose
#: selected scores are all 0 renormalises to 0/0 in the kernel (the contract adds 1e-20).
SIGMOID_MIN_LOGIT = -80.0

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "kunlun_ops.rmsnorm": "weight passed as float32 (exact for any weight dtype)",
    "kunlun_ops.silu_and_mul": "turn=True: silu of the first half times the second",
    "kunlun_ops.reshape_and_cache": "key-only write (value=None), int32 slots; no FP8 on P800",
    "moe_sigmoid_group_topk_norm": f"<= {chips.MOE_MAX_EXPERTS} experts; always renormalises "
                                   f"(norm_topk_prob=False declined) by a plain sum (logits below "
                                   f"{SIGMOID_MIN_LOGIT:g} declined)",
    "moe_softmax_topk(_norm)": f"<= {chips.MOE_MAX_EXPERTS} experts; no selection bias, no expert groups",
    "moe_pre_sorted / gen_block_statistic": f"<= {chips.MOE_MAX_EXPERTS} experts, counting one extra "
                                            "expert for dropped ids",
    "moe_post": "one row per (token, slot): repeated src entries are declined",
    "moe_fc": f"act=None only (the fused SWISH_GLU is wrong for M >= {chips.SWISH_GLU_BROKEN_FROM_ROWS}); "
              f"<= {chips.MOE_MAX_EXPERTS} experts",
    "xspeedgate_ops.hadamard_transform": f"D <= {chips.HADAMARD_MAX_DIM}; needs xspeedgate_ops",
    "indexer": "int8-quantised keys and queries (I8_paged_mqa_logits): declined, not the bf16/FP8 contract",
    "sparse_mla_decode_paged / kv_cache_gather (XPU C++)": f"Dqk <= {DECODE_MAX_DQK}, H <= {DECODE_MAX_HEADS}",
}

INDEXER_DECLINED = ("the Kunlun indexer kernels (I8_paged_mqa_logits / I8_mqa_logits) score int8-quantised "
                    "queries and keys; the contract's bf16/fp16/FP8 logits would change, so the backend "
                    "declines rather than quantising silently")


def declare(backend: "KunlunBackend") -> None:
    """Declares every adapter on `backend` (closures over it: one set per instance)."""
    for family in (_declare_common, _declare_moe, _declare_kv, _declare_dsa):
        family(backend)


def sigmoid_underflow(logits: Tensor, kernel: str) -> str | None:
    """The reason to decline a renormalised sigmoid routing whose float32 scores may be 0."""
    if logits.numel() and bool(logits.min() < SIGMOID_MIN_LOGIT):
        return (f"logits below {SIGMOID_MIN_LOGIT:g}: their float32 sigmoid scores underflow, and {kernel} "
                "renormalises by a plain sum (0/0 is NaN; the contract adds 1e-20)")
    return None


def has_op(namespace: Any, name: str) -> bool:
    """Whether a torch.ops namespace (or a stand-in) has `name`; torch.ops raises
    AttributeError or RuntimeError for an unregistered op."""
    try:
        return getattr(namespace, name, None) is not None
    except (AttributeError, RuntimeError):
        return False


def _missing_ops(backend: "KunlunBackend", *names: str) -> str | None:
    absent = [n for n in names if not has_op(backend.runtime.C, n)]
    if absent:
        return (f"torch.ops._C lacks {', '.join(absent)} (vLLM-Kunlun's kernel library is not loaded in this "
                "process)")
    return None


def _experts_over(count: int, what: str, limit: int = chips.MOE_MAX_EXPERTS) -> str | None:
    if count > limit:
        return f"{what} takes at most {limit} experts on P800, got {count}"
    return None


# -- shared conversions ------------------------------------------------------------------------
def contract_order(src: Tensor, tokens_per_expert: Tensor, slots: int) -> Tensor | None:
    """The permutation putting expert-grouped rows into the contract's order (ascending flat
    index within each expert), or None when they already are (vLLM-Kunlun's torch
    equivalent of moe_pre_sorted sorts stably; the kernel's order is not documented)."""
    rows = src.shape[0]
    if rows < 2:
        return None
    experts = torch.arange(tokens_per_expert.shape[0], device=src.device)
    expert_of_row = torch.repeat_interleave(experts, tokens_per_expert.long(), output_size=rows)
    key = expert_of_row * slots + src.long()
    if bool((key[1:] > key[:-1]).all()):
        return None
    return torch.argsort(key)


def repeated_slot(src: Tensor, slots: int) -> str | None:
    if src.numel() < 2:
        return None
    if bool((torch.bincount(src.long(), minlength=slots) > 1).any()):
        return "src repeats a (token, slot) index; moe_post combines one row per pair"
    return None


# -- common ------------------------------------------------------------------------------------
def _declare_common(backend: "KunlunBackend") -> None:
    @backend.impl("rms_norm", dtypes=FLOATS)
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.numel() == 0:
            return torch.empty_like(x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        # kunlun_ops.rmsnorm takes its weight in float32 whatever x's dtype (exact for any weight).
        backend.runtime.kunlun_ops.rmsnorm(rows, weight.to(_F32).contiguous(), float(eps), out=out)
        return out.view(x.shape)

    @backend.impl("silu_and_mul", dtypes=FLOATS)
    def silu_and_mul(x: Tensor) -> Tensor:
        out_shape = (*x.shape[:-1], x.shape[-1] // 2)
        if x.numel() == 0:
            return x.new_empty(out_shape)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = rows.new_empty((rows.shape[0], rows.shape[1] // 2))
        # turn=True is vLLM-Kunlun's silu_and_mul: silu(x[..., :N]) * x[..., N:], the contract's order.
        backend.runtime.kunlun_ops.silu_and_mul(rows, axis=-1, turn=True, out=out)
        return out.view(out_shape)

    def hadamard_supported(x: Tensor, scale: float) -> Verdict:
        runtime = backend.runtime
        if runtime.xspeedgate is None or not has_op(runtime.xspeedgate, "hadamard_transform"):
            return runtime.xspeedgate_missing or "torch.ops.xspeedgate_ops.hadamard_transform is not registered"
        if x.shape[-1] > chips.HADAMARD_MAX_DIM:
            return f"xspeedgate_ops.hadamard_transform takes D <= {chips.HADAMARD_MAX_DIM}, got {x.shape[-1]}"
        return True

    @backend.impl("hadamard_transform", dtypes=FLOATS, supports=hadamard_supported)
    def hadamard_transform(x: Tensor, scale: float) -> Tensor:
        if x.numel() == 0:
            return torch.empty_like(x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return backend.runtime.xspeedgate.hadamard_transform(rows, float(scale)).view(x.shape)


# -- MoE ---------------------------------------------------------------------------------------
def _declare_moe(backend: "KunlunBackend") -> None:
    def route_supported(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
                        score_func) -> Verdict:
        experts = logits.shape[1]
        if score_func == "sigmoid":
            return first_reason(
                lambda: _missing_ops(backend, "moe_sigmoid_group_topk_norm"),
                lambda: _experts_over(experts, "moe_sigmoid_group_topk_norm"),
                lambda: None if norm_topk_prob else
                "moe_sigmoid_group_topk_norm always renormalises the selected weights (norm_topk_prob=False)",
                lambda: sigmoid_underflow(logits, "moe_sigmoid_group_topk_norm"))
        kernel = "moe_softmax_topk_norm" if norm_topk_prob else "moe_softmax_topk"
        return first_reason(
            lambda: _missing_ops(backend, kernel),
            lambda: _experts_over(experts, kernel),
            lambda: None if bias is None else f"{kernel} has no selection bias (no Kunlun softmax kernel takes one)",
            lambda: None if n_group == 1 else f"{kernel} does not limit experts to groups (n_group={n_group})")

    @backend.impl("moe_route", dtypes=FLOATS, supports=route_supported)
    def moe_route(logits: Tensor, bias: Tensor | None, top_k: int, n_group: int, topk_group: int,
                  routed_scaling_factor: float, norm_topk_prob: bool, score_func: str) -> tuple[Tensor, Tensor]:
        tokens, experts = logits.shape
        weights = logits.new_empty((tokens, top_k), dtype=_F32)
        ids = logits.new_empty((tokens, top_k), dtype=_I32)
        if tokens == 0:
            return weights, ids
        C = backend.runtime.C
        scores = logits.contiguous()
        if score_func == "sigmoid":
            histogram = logits.new_empty((chips.BLOCK_STATISTIC_ROWS, experts), dtype=_I32)
            C.moe_sigmoid_group_topk_norm(
                x=scores, topk_index=ids, norm_score=weights, block_static=histogram,
                bias=None if bias is None else bias.to(_F32).contiguous(),
                scale=float(routed_scaling_factor), n_group=n_group, topk_group=topk_group)
        else:
            softmax_topk = C.moe_softmax_topk_norm if norm_topk_prob else C.moe_softmax_topk
            softmax_topk(x=scores, normed_score=weights, topk_index=ids, block_statistic=None)
            if routed_scaling_factor != 1.0:
                weights.mul_(float(routed_scaling_factor))
        return weights, ids

    def permute_supported(x: Tensor, ids: Tensor, num_experts: int) -> Verdict:
        return first_reason(
            lambda: _missing_ops(backend, "gen_block_statistic", "moe_pre_sorted"),
            # one extra expert collects the ids the contract drops
            lambda: _experts_over(num_experts + 1, "moe_pre_sorted (with the dropped-id expert)"))

    @backend.impl("moe_permute", dtypes=FLOATS, supports=permute_supported)
    def moe_permute(x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        tokens, k = ids.shape
        slots = tokens * k
        if slots == 0:
            return (x.new_empty((0, x.shape[1])), ids.new_zeros(num_experts, dtype=_I32),
                    ids.new_empty(0, dtype=_I32))
        C = backend.runtime.C
        # Ids the contract drops (-1, other ranks' experts) go to expert `num_experts`, which
        # sorts after the real ones; its rows are cut off below.
        dropped = (ids < 0) | (ids >= num_experts)
        expert_num = num_experts + 1 if bool(dropped.any()) else num_experts
        topk_index = torch.where(dropped, num_experts, ids).to(_I32).contiguous()
        histogram = ids.new_empty((chips.BLOCK_STATISTIC_ROWS, expert_num), dtype=_I32)
        C.gen_block_statistic(topk_index, histogram)
        expanded = x.new_empty((slots, x.shape[1]))
        slot_to_row = ids.new_empty(slots, dtype=_I32)
        expert_m = ids.new_empty(expert_num, dtype=_I32)
        lod = ids.new_empty(expert_num + 1, dtype=_I32)
        C.moe_pre_sorted(x=x.contiguous(), topk_index=topk_index, block_statistic=histogram, moe_expand=expanded,
                         moe_index=slot_to_row, expert_m=expert_m, sorted_tokens_num_lod=lod)
        rows = int(lod[num_experts])
        src = torch.empty(slots, dtype=_I32, device=ids.device)
        src[slot_to_row.long()] = torch.arange(slots, dtype=_I32, device=ids.device)
        x_perm, src = expanded[:rows], src[:rows]
        tokens_per_expert = expert_m[:num_experts].clone()
        order = contract_order(src, tokens_per_expert, slots)
        if order is not None:
            x_perm, src = x_perm[order], src[order]
        return x_perm, tokens_per_expert, src

    def unpermute_supported(y: Tensor, src: Tensor, weights: Tensor) -> Verdict:
        return first_reason(lambda: _missing_ops(backend, "moe_post"),
                             lambda: repeated_slot(src, weights.shape[0] * weights.shape[1]))

    @backend.impl("moe_unpermute", dtypes=FLOATS, supports=unpermute_supported)
    def moe_unpermute(y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
        tokens, k = weights.shape
        out = y.new_empty((tokens, y.shape[1]))
        if tokens == 0:
            return out
        slots = tokens * k
        # Row src[r] of a [T*k, D] buffer holds y[r] (pairs without a row hold 0), so the
        # slot -> row map moe_post reads is the identity.
        by_slot = y.new_zeros((slots, y.shape[1]))
        by_slot[src.long()] = y
        slot_to_row = torch.arange(slots, dtype=_I32, device=y.device).view(tokens, k)
        backend.runtime.C.moe_post(x=by_slot, moe_index=slot_to_row, normed_scale=weights.contiguous(),
                                   dequant_scale=torch.ones_like(weights, dtype=_F32), y=out)
        return out

    def grouped_gemm_supported(x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Verdict:
        return first_reason(lambda: _missing_ops(backend, "moe_fc"),
                             lambda: _experts_over(w.shape[0], "moe_fc"))

    @backend.impl("grouped_gemm", dtypes=FLOATS, supports=grouped_gemm_supported)
    def grouped_gemm(x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
        rows, experts = x.shape[0], w.shape[0]
        if rows == 0 or w.shape[1] == 0:
            return x.new_zeros((rows, w.shape[1]))
        # moe_fc is shaped for routed tokens; rows already grouped by expert are routed tokens
        # with top-1 routing whose sorted position is their own index.
        lod = torch.zeros(experts + 1, dtype=_I32, device=x.device)
        lod[1:] = torch.cumsum(tokens_per_expert, 0).to(_I32)
        expert_of_row = torch.repeat_interleave(torch.arange(experts, dtype=_I32, device=x.device),
                                                tokens_per_expert.long(), output_size=rows)
        y = x.new_empty((rows, w.shape[1]))
        backend.runtime.C.moe_fc(x=x.contiguous(), weight=w.contiguous(), sorted_tokens_num_lod=lod,
                                 sorted_tokens_idx=torch.arange(rows, dtype=_I32, device=x.device), moe_topk=1,
                                 y=y, topk_ids=expert_of_row.view(rows, 1), act=None)
        return y


# -- KV cache ----------------------------------------------------------------------------------
def _declare_kv(backend: "KunlunBackend") -> None:
    def kv_write_supported(cache: Tensor, values: Tensor, slot_mapping: Tensor) -> Verdict:
        if cache.shape[0] * cache.shape[1] > INT32_MAX:
            return "kunlun_ops.reshape_and_cache takes int32 slots; this cache has more than 2^31-1"
        return True

    @backend.impl("kv_cache_write", dtypes=FLOATS, supports=kv_write_supported)
    def kv_cache_write(cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
        tokens, dim = values.shape
        if tokens == 0:
            return None
        blocks, block_size = cache.shape[0], cache.shape[1]
        # Key-only, one head: the MLA latent row is the whole cache row.
        backend.runtime.kunlun_ops.reshape_and_cache(
            values.reshape(tokens, 1, dim).contiguous(), None, cache.view(blocks, 1, block_size, dim), None,
            slot_mapping.to(_I32).contiguous())
        return None

    def gather_supported(cache: Tensor, block_table: Tensor, context_lens: Tensor) -> Verdict:
        return first_reason(backend.kernels.missing)

    @backend.impl("kv_cache_gather", dtypes=FLOATS, supports=gather_supported)
    def kv_cache_gather(cache: Tensor, block_table: Tensor, context_lens: Tensor) -> Tensor:
        lengths = context_lens.long()
        total = int(lengths.sum()) if lengths.numel() else 0
        out = cache.new_empty((total, cache.shape[2]))
        if total == 0:
            return out
        offsets = (torch.cumsum(lengths, 0) - lengths).contiguous()
        backend.kernels.kv_cache_gather(cache.contiguous(), block_table.contiguous(), context_lens.contiguous(),
                                        offsets, out, backend.runtime.current_stream(cache.device))
        return out


# -- DSA ---------------------------------------------------------------------------------------
def _declare_dsa(backend: "KunlunBackend") -> None:
    def indexer_declined(*args) -> Verdict:
        return INDEXER_DECLINED

    @backend.impl("indexer_topk", dtypes=FLOATS, supports=indexer_declined)
    def indexer_topk(*args) -> Tensor:
        raise AssertionError("indexer_topk is always declined on kunlun (supports says why)")

    @backend.impl("indexer_topk_paged", dtypes=FLOATS, supports=indexer_declined)
    def indexer_topk_paged(*args) -> Tensor:
        raise AssertionError("indexer_topk_paged is always declined on kunlun (supports says why)")

    def sparse_decode_supported(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v) -> Verdict:
        heads, dqk = q.shape[2], q.shape[3]
        return first_reason(
            backend.kernels.missing,
            lambda: None if dqk <= DECODE_MAX_DQK else
            f"the XPU sparse decode kernel takes Dqk <= {DECODE_MAX_DQK}, got {dqk}",
            lambda: None if heads <= DECODE_MAX_HEADS else
            f"the XPU sparse decode kernel takes H <= {DECODE_MAX_HEADS}, got {heads}",
            lambda: None if kv_cache.shape[0] * kv_cache.shape[1] <= INT32_MAX else
            "the XPU sparse decode kernel addresses cache rows with int32")

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
            indices.contiguous(), out, lse, sm_scale, backend.runtime.current_stream(q.device))
        return out, lse
