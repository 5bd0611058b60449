"""Adapters from glm5_hal's canonical ops to Kunlun's kernels: `kunlun_ops`, the vLLM-Kunlun
MoE kernels registered in `torch.ops._C`, `torch.ops.xspeedgate_ops`, and the backend's own
XPU C++ kernels.

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
KunlunBackend instance binds to itself; it reaches the vendor through `backend.runtime` (the
real modules, or an emulator in tests), so several instances coexist. Inputs arrive
validated by glm5_hal.ops; an adapter converts layouts (Kunlun's paged caches are [blocks,
heads, block_size, dim]; the contract's have one head) and index conventions
(moe_pre_sorted's slot -> row map), calls the vendor op exactly as vLLM-Kunlun calls it
(keyword names, argument dtypes, the empty block_statistic, float32 router logits) and returns
exactly the canonical outputs. Each adapter's predicate checks the vendor's per-call limits and the
installed vLLM-Kunlun version (chips.BEHAVIOURS), declining with a reason where the public
sources stop. No adapter reads device data on the host except where the op's output size is
the data (moe_permute's row count, kv_cache_gather's total length: one scalar each).
README.md has the table. The indexer ops are not implemented (see INDEXER_NOT_SERVED).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from glm5_hal.vendor_backend import Adapter, Verdict, first_reason
from glm5_hal.vendor_ops.dsa import SPARSE_MLA_DECODE_PAGED
from glm5_hal.vendor_ops.kv import int32_slots_declined, paged_view_declined, write_key_rows
from glm5_hal.vendor_ops.moe import (SIGMOID_MIN_LOGIT, no_permuted_rows, permuted_in_contract_order, repeated_slot,
                                     sigmoid_underflow, spare_expert_ids)

from . import chips
from .kernels import KernelLibrary

if TYPE_CHECKING:
    from . import KunlunBackend

_F32, _F16, _BF16, _I32, _I64 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64
_FP8 = torch.float8_e4m3fn
FLOATS = (_F32, _F16, _BF16)
_DECODE = KernelLibrary.decode_limits
_MAX_E = chips.MOE_MAX_EXPERTS

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "kunlun_ops.rmsnorm": "weight passed as float32 (exact for any weight dtype), as KunlunOps.rms_norm does",
    "kunlun_ops.silu_and_mul": "turn=True: silu of the first half times the second",
    "kunlun_ops.reshape_and_cache": "key-only write (value=None), int32 slots; no FP8 on P800",
    "moe_sigmoid_group_topk_norm": f"<= {_MAX_E} experts (UNVERIFIED beyond); always renormalises "
                                   f"(norm_topk_prob=False declined) by a plain sum (logits below "
                                   f"{SIGMOID_MIN_LOGIT:g} declined); float32 logits",
    "moe_softmax_topk(_norm)": f"<= {_MAX_E} experts (UNVERIFIED beyond); no selection bias, no expert groups; "
                               "float32 logits",
    "moe_pre_sorted / gen_block_statistic": f"<= {_MAX_E} experts, counting one extra expert for dropped ids",
    "moe_post": "one row per (token, slot): repeated src entries are declined",
    "moe_fc": f"act=None, no topk_ids (as vLLM-Kunlun's unquantised fused_moe calls it); <= {_MAX_E} experts",
    "xspeedgate_ops.hadamard_transform": f"D <= {chips.HADAMARD_MAX_DIM} (UNVERIFIED); needs xspeedgate_ops",
    "_C.matmul / moe_fc (W8A8)": "int8_gemm / int8_grouped_gemm with per-token and per-channel maxima (scale * 127), "
                                 "as vLLM-Kunlun's W8A8 path calls them (vllm-kunlun >= 0.11.0); bf16/fp16 out only",
    "vLLM-Kunlun": f"the _C MoE kernels as registered by vllm-kunlun 0.10.1.1 - 0.15.1 "
                   f"(chips.MOE_KERNELS); other versions are declined",
    "indexer": "not implemented: the Kunlun kernels score int8-quantised keys and queries (I8_paged_mqa_logits)",
    "sparse_mla_decode_paged / kv_cache_gather (XPU C++)": f"Dqk <= {_DECODE.max_dqk}, H <= {_DECODE.max_heads}",
}

#: Why indexer_topk and indexer_topk_paged are not implemented here (they run elsewhere).
INDEXER_NOT_SERVED = ("the Kunlun indexer kernels (I8_paged_mqa_logits / I8_mqa_logits) score int8-quantised "
                      "queries and keys; the contract's bf16/fp16/FP8 logits would change, so the backend "
                      "does not implement the indexer rather than quantising silently")


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


def _experts_over(count: int, what: str, limit: int = _MAX_E) -> str | None:
    if count > limit:
        return (f"{what} is verified only up to {limit} experts (no public source states its ceiling; "
                f"vLLM-Kunlun's tutorials serve {limit}), got {count}")
    return None


def _moe_declined(backend: "KunlunBackend", *names: str) -> str | None:
    """The `_C` MoE kernels are vLLM-Kunlun's: missing, or registered by an unverified version."""
    return _missing_ops(backend, *names) or backend.unverified("moe_kernels")


# -- common ------------------------------------------------------------------------------------
def rms_norm(backend: "KunlunBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    # kunlun_ops.rmsnorm takes its weight in float32 whatever x's dtype (exact for any weight).
    backend.runtime.kunlun_ops.rmsnorm(rows, weight.to(_F32).contiguous(), float(eps), out=out)
    return out.view(x.shape)


def silu_and_mul(backend: "KunlunBackend", x: Tensor) -> Tensor:
    out_shape = (*x.shape[:-1], x.shape[-1] // 2)
    if x.numel() == 0:
        return x.new_empty(out_shape)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = rows.new_empty((rows.shape[0], rows.shape[1] // 2))
    # turn=True is vLLM-Kunlun's silu_and_mul: silu(x[..., :N]) * x[..., N:], the contract's order.
    backend.runtime.kunlun_ops.silu_and_mul(rows, axis=-1, turn=True, out=out)
    return out.view(out_shape)


def hadamard_transform_supported(backend: "KunlunBackend", x: Tensor, scale: float) -> Verdict:
    runtime = backend.runtime
    if runtime.xspeedgate is None or not has_op(runtime.xspeedgate, "hadamard_transform"):
        return runtime.xspeedgate_missing or "torch.ops.xspeedgate_ops.hadamard_transform is not registered"
    if x.shape[-1] > chips.HADAMARD_MAX_DIM:
        return f"xspeedgate_ops.hadamard_transform takes D <= {chips.HADAMARD_MAX_DIM}, got {x.shape[-1]}"
    return True


def hadamard_transform(backend: "KunlunBackend", x: Tensor, scale: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return backend.runtime.xspeedgate.hadamard_transform(rows, float(scale)).view(x.shape)


# -- MoE ---------------------------------------------------------------------------------------
def moe_route_supported(backend: "KunlunBackend", logits, bias, top_k, n_group, topk_group, routed_scaling_factor,
                        norm_topk_prob, score_func) -> Verdict:
    experts = logits.shape[1]
    if score_func == "sigmoid":
        return first_reason(
            lambda: _moe_declined(backend, "moe_sigmoid_group_topk_norm"),
            lambda: _experts_over(experts, "moe_sigmoid_group_topk_norm"),
            lambda: None if norm_topk_prob else
            "moe_sigmoid_group_topk_norm always renormalises the selected weights (norm_topk_prob=False)",
            lambda: sigmoid_underflow(logits, "moe_sigmoid_group_topk_norm"))
    kernel = "moe_softmax_topk_norm" if norm_topk_prob else "moe_softmax_topk"
    return first_reason(
        lambda: _moe_declined(backend, kernel),
        lambda: _experts_over(experts, kernel),
        lambda: None if bias is None else f"{kernel} has no selection bias (no Kunlun softmax kernel takes one)",
        lambda: None if n_group == 1 else f"{kernel} does not limit experts to groups (n_group={n_group})")


def moe_route(backend: "KunlunBackend", logits: Tensor, bias: Tensor | None, top_k: int, n_group: int, topk_group: int,
              routed_scaling_factor: float, norm_topk_prob: bool, score_func: str) -> tuple[Tensor, Tensor]:
    tokens, experts = logits.shape
    weights = logits.new_empty((tokens, top_k), dtype=_F32)
    ids = logits.new_empty((tokens, top_k), dtype=_I32)
    if tokens == 0:
        return weights, ids
    C = backend.runtime.C
    # vLLM-Kunlun's fused_moe casts the router logits to float32 before any routing kernel
    # (`router_logits = router_logits.to(torch.float)`, ops/_kunlun_ops.py:412 @09869ee), so the
    # scores buffer and the logits always share a dtype
    scores = logits.to(_F32).contiguous()
    if score_func == "sigmoid":
        # zero-filled as vLLM-Kunlun's fused_moe does (torch.zeros, ops/_kunlun_ops.py:406 @09869ee;
        # compressed_tensors_moe.py:144): the kernels need not write every row of it
        histogram = logits.new_zeros((chips.BLOCK_STATISTIC_ROWS, experts), dtype=_I32)
        # `bias` is a plain Tensor in the schema, and vLLM-Kunlun always passes one: a zero
        # bias selects exactly what no bias would
        bias = logits.new_zeros(experts, dtype=_F32) if bias is None else bias.to(_F32).contiguous()
        C.moe_sigmoid_group_topk_norm(
            x=scores, topk_index=ids, norm_score=weights, block_static=histogram, bias=bias,
            scale=float(routed_scaling_factor), n_group=n_group, topk_group=topk_group)
    else:
        if norm_topk_prob:
            # as fused_moe calls it (ops/_kunlun_ops.py:414-420 @09869ee)
            C.moe_softmax_topk_norm(x=scores, normed_score=weights, topk_index=ids, block_statistic=None)
        else:
            # `block_statistic` is a plain Tensor in this kernel's schema: vLLM-Kunlun's
            # fused_moe_ep passes an empty int32 tensor (ops/_kunlun_ops.py:665-668 @09869ee)
            no_statistic = logits.new_empty(0, dtype=_I32)
            C.moe_softmax_topk(scores, weights, ids, no_statistic)
        if routed_scaling_factor != 1.0:
            weights.mul_(float(routed_scaling_factor))
    return weights, ids


def moe_permute_supported(backend: "KunlunBackend", x: Tensor, ids: Tensor, num_experts: int) -> Verdict:
    return first_reason(
        lambda: _moe_declined(backend, "gen_block_statistic", "moe_pre_sorted"),
        # one extra expert collects the ids the contract drops
        lambda: _experts_over(num_experts + 1, "moe_pre_sorted (with the dropped-id expert)"))


def moe_permute(backend: "KunlunBackend", x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    slots = ids.numel()
    if slots == 0:
        return no_permuted_rows(x, ids, num_experts)
    C = backend.runtime.C
    # the dropped ids go to a spare expert, which sorts after the real ones: its rows are cut off
    topk_index, expert_num = spare_expert_ids(ids, num_experts)
    # block_statistic, moe_index, expert_m and sorted_tokens_num_lod start at zero, as every
    # vLLM-Kunlun call site allocates them (torch.zeros: ops/_kunlun_ops.py:406, 534-548 @09869ee,
    # compressed_tensors_moe.py:144, 176-185 @09869ee; the same at v0.10.1.1 ba13599 and v0.11.0
    # e9f0322): the closed kernels are not documented to write every entry
    histogram = ids.new_zeros((chips.BLOCK_STATISTIC_ROWS, expert_num), dtype=_I32)
    C.gen_block_statistic(topk_index, histogram)
    expanded = x.new_empty((slots, x.shape[1]))       # written whole (torch.empty in vLLM-Kunlun too)
    slot_to_row = ids.new_zeros(slots, dtype=_I32)
    expert_m = ids.new_zeros(expert_num, dtype=_I32)
    lod = ids.new_zeros(expert_num + 1, dtype=_I32)
    C.moe_pre_sorted(x=x.contiguous(), topk_index=topk_index, block_statistic=histogram, moe_expand=expanded,
                     moe_index=slot_to_row, expert_m=expert_m, sorted_tokens_num_lod=lod)
    rows = int(lod[num_experts])   # the output size is the data: the op's one host read
    return permuted_in_contract_order(expanded[:rows], slot_to_row, expert_m[:num_experts].clone())


def moe_unpermute_supported(backend: "KunlunBackend", y: Tensor, src: Tensor, weights: Tensor) -> Verdict:
    return first_reason(lambda: _moe_declined(backend, "moe_post"),
                        lambda: repeated_slot(src, weights.shape[0] * weights.shape[1], "moe_post"))


def moe_unpermute(backend: "KunlunBackend", y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
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


def grouped_gemm_supported(backend: "KunlunBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Verdict:
    return first_reason(lambda: _moe_declined(backend, "moe_fc"),
                        lambda: _experts_over(w.shape[0], "moe_fc"))


def grouped_gemm(backend: "KunlunBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    rows, experts = x.shape[0], w.shape[0]
    if rows == 0 or w.shape[1] == 0:
        return x.new_zeros((rows, w.shape[1]))
    # moe_fc is shaped for routed tokens (x sorted by expert, y [tokens, topk, N] in the same
    # order); rows already grouped by expert are routed tokens with top-1 routing whose sorted
    # position is their own index. Called as vLLM-Kunlun's unquantised fused_moe calls it: no
    # act, no topk_ids (ops/_kunlun_ops.py:577-606 @09869ee).
    lod = torch.zeros(experts + 1, dtype=_I32, device=x.device)
    lod[1:] = torch.cumsum(tokens_per_expert, 0).to(_I32)
    y = x.new_empty((rows, 1, w.shape[1]))
    backend.runtime.C.moe_fc(x=x.contiguous(), weight=w.contiguous(), sorted_tokens_num_lod=lod,
                             sorted_tokens_idx=torch.arange(rows, dtype=_I32, device=x.device), moe_topk=1, y=y)
    return y.view(rows, w.shape[1])


# -- the checkpoints' INT8 GEMMs: vLLM-Kunlun's W8A8 kernels ----------------------------------------
_I8 = torch.int8


def _w8a8_declined(backend: "KunlunBackend", out_dtype: torch.dtype, kernel: str) -> str | None:
    return (_missing_ops(backend, kernel) or backend.unverified("w8a8_max_scales")
            or (None if out_dtype in (_F16, _BF16) else
                f"{kernel} is called with the activations' bf16/fp16 as out_dtype by vLLM-Kunlun; "
                f"{out_dtype} is UNVERIFIED"))


def _as_max(backend: "KunlunBackend", scale: Tensor) -> Tensor:
    """A per-row / per-channel scale as the maximum kunlun_ops takes ("use max as scale")."""
    return (scale.to(_F32) * backend.behaviour("w8a8_max_scales")).unsqueeze(-1).contiguous()


def int8_gemm_supported(backend: "KunlunBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                        out_dtype: torch.dtype, bias: Tensor | None) -> Verdict:
    return _w8a8_declined(backend, out_dtype, "matmul") or True


def int8_gemm(backend: "KunlunBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
              out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """torch.ops._C.matmul(x, w [N, K], out_dtype, x_pc_max=, w_pc_max=, bias=) as vLLM-Kunlun's
    W8A8 linear calls it (quantization/kernels/scale_mm.py:83-91 @09869ee)."""
    rows, cols = x.shape[0], w.shape[0]
    if rows == 0 or cols == 0 or x.shape[1] == 0:    # nothing to multiply: the contract's result
        out = x.new_zeros((rows, cols), dtype=_F32)
        return (out if bias is None else out + bias.to(_F32)).to(out_dtype)
    return backend.runtime.C.matmul(
        x=x.contiguous(), w=w.contiguous(), out_dtype=out_dtype, x_pc_max=_as_max(backend, x_scale),
        w_pc_max=_as_max(backend, w_scale), bias=None if bias is None else bias.to(_F32).contiguous())


def int8_grouped_gemm_supported(backend: "KunlunBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                                tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Verdict:
    return first_reason(lambda: _moe_declined(backend, "moe_fc"),
                        lambda: _w8a8_declined(backend, out_dtype, "moe_fc"),
                        lambda: _experts_over(w.shape[0], "moe_fc"))


def int8_grouped_gemm(backend: "KunlunBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                      tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Tensor:
    """moe_fc with int8 x and weights, as vLLM-Kunlun's W8A8 MoE calls it
    (quantization/compressed_tensors/compressed_tensors_moe.py:226-236 @09869ee): rows grouped by
    expert are top-1 routed tokens whose sorted position is their own index; topk_ids, which
    that path always passes, are each row's expert."""
    rows, experts, cols = x.shape[0], w.shape[0], w.shape[1]
    if rows == 0 or cols == 0 or x.shape[1] == 0:
        return x.new_zeros((rows, cols), dtype=out_dtype)
    lod = torch.zeros(experts + 1, dtype=_I32, device=x.device)
    lod[1:] = torch.cumsum(tokens_per_expert, 0).to(_I32)
    expert_of_row = torch.repeat_interleave(torch.arange(experts, dtype=_I32, device=x.device),
                                            tokens_per_expert.long(), output_size=rows)
    y = x.new_empty((rows, 1, cols), dtype=out_dtype)
    backend.runtime.C.moe_fc(x=x.contiguous(), weight=w.contiguous(), sorted_tokens_num_lod=lod,
                             sorted_tokens_idx=torch.arange(rows, dtype=_I32, device=x.device), moe_topk=1, y=y,
                             x_perchannel_max=_as_max(backend, x_scale), w_perchannel_max=_as_max(backend, w_scale),
                             topk_ids=expert_of_row.view(rows, 1))
    return y.view(rows, cols)


# -- KV cache ----------------------------------------------------------------------------------
def kv_cache_write_supported(backend: "KunlunBackend", cache: Tensor, values: Tensor, slot_mapping: Tensor) -> Verdict:
    return (int32_slots_declined(cache, "kunlun_ops.reshape_and_cache")
            or paged_view_declined("kunlun_ops.reshape_and_cache", cache) or True)


def kv_cache_write(backend: "KunlunBackend", cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    write_key_rows(backend.runtime.kunlun_ops.reshape_and_cache, cache, values, slot_mapping)


def kv_cache_gather_supported(backend: "KunlunBackend", cache: Tensor, block_table: Tensor,
                              context_lens: Tensor) -> Verdict:
    return backend.kernels.missing() or True


def kv_cache_gather(backend: "KunlunBackend", cache: Tensor, block_table: Tensor, context_lens: Tensor) -> Tensor:
    lengths = context_lens.long()
    total = int(lengths.sum()) if lengths.numel() else 0   # the output size is the data: the op's one host read
    out = cache.new_empty((total, cache.shape[2]))
    if total == 0:
        return out
    offsets = (torch.cumsum(lengths, 0) - lengths).contiguous()
    backend.kernels.kv_cache_gather(cache.contiguous(), block_table.contiguous(), context_lens.contiguous(),
                                    offsets, out, backend.stream(cache.device))
    return out


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS),
    Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS),
    Adapter("hadamard_transform", hadamard_transform, dtypes=FLOATS, supports_metadata=hadamard_transform_supported),
    # per call: sigmoid underflow is a data check on the logits
    Adapter("moe_route", moe_route, dtypes=FLOATS, supports=moe_route_supported),
    Adapter("moe_permute", moe_permute, dtypes=FLOATS, supports_metadata=moe_permute_supported),
    # per call: a repeated (token, slot) in src is a data check
    Adapter("moe_unpermute", moe_unpermute, dtypes=FLOATS, supports=moe_unpermute_supported),
    Adapter("grouped_gemm", grouped_gemm, dtypes=FLOATS, supports_metadata=grouped_gemm_supported),
    Adapter("int8_gemm", int8_gemm, dtypes=(_I8,), supports_metadata=int8_gemm_supported),
    Adapter("int8_grouped_gemm", int8_grouped_gemm, dtypes=(_I8,), supports_metadata=int8_grouped_gemm_supported),
    # per call: reads the cache's contiguity (the call key holds only whether it is paged)
    Adapter("kv_cache_write", kv_cache_write, dtypes=FLOATS, supports=kv_cache_write_supported),
    Adapter("kv_cache_gather", kv_cache_gather, dtypes=FLOATS, supports_metadata=kv_cache_gather_supported),
    SPARSE_MLA_DECODE_PAGED,   # the XPU C++ kernel (kernels.py)
)
