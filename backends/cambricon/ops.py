"""Adapters from glm5_hal's canonical ops to torch_mlu_ops (`tmo`) and the backend's BANG C
kernels.

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
CambriconBackend instance binds to itself; it reaches the vendor through
`backend.runtime.tmo` (the real torch_mlu_ops, or an emulator in tests), so several
instances coexist. Inputs arrive validated by glm5_hal.ops; an adapter converts layouts and
index conventions (tmo's paged caches are [blocks, heads, block_size, dim]; the contract's
are [blocks, block_size, dim], i.e. one head), calls the vendor op and returns exactly the
canonical outputs. Each adapter's predicate checks the documented per-call constraints of the tmo
op and returns a reason when a call falls outside them, so dispatch moves on instead of the
vendor op failing on the device. Semantics follow the torch_mlu_ops 1.12.1 docstrings
("Math:" sections; chips.TMO_API: any other torch_mlu_ops version declines every tmo adapter),
summarised in README.md. No adapter reads device data on the host, except where the op's
output size is the data (moe_permute's row count, kv_cache_gather's total length).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from glm5_hal.vendor_backend import Adapter, Verdict, dtype_name, first_reason
from glm5_hal.vendor_ops.common import weight_cast_declined
from glm5_hal.vendor_ops.dsa import SPARSE_MLA_DECODE_PAGED, pad_heads
from glm5_hal.vendor_ops.kv import int32_slots_declined, paged_view_declined, write_key_rows
from glm5_hal.vendor_ops.moe import (SIGMOID_MIN_LOGIT, no_permuted_rows, permuted_in_contract_order, repeated_slot,
                                     sigmoid_underflow, spare_expert_ids)

from .kernels import KernelLibrary

if TYPE_CHECKING:
    from . import CambriconBackend

_F32, _F16, _BF16, _I8, _I32, _I64 = (torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                      torch.int32, torch.int64)
_FP8 = torch.float8_e4m3fn
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

# -- vendor constraints (torch_mlu_ops 1.12.1 docstrings; see README.md) ----------------------
ROTARY_MAX_HEAD_SIZE = 256            # apply_rotary: head_size in [2, 256]
INDEXER_HEADS = (32, 64)              # masked_indexer_select_paged_kv: head_num 32 or 64
INDEXER_DIM = 128                     # ... head_size 128
FP8_MAX, FP8_MIN_AMAX = 448.0, 1e-4   # the fp8 rule of the contract (docs/ops/quant.md, fp8_block_quant)
_DECODE = KernelLibrary.decode_limits

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
    "indexer_k_cache_write": "FP8 MLUs only (torch.mlu.is_fp8_supported()); quantised on the device, rows and "
                             "scales written with tmo.reshape_paged_cache (which skips -1 slots)",
    "tmo.masked_indexer_select_paged_kv": f"head_size {INDEXER_DIM}, <= {INDEXER_HEADS[-1]} heads "
                                          f"(zero-padded to {INDEXER_HEADS}), bf16/fp16, one decode row per "
                                          "query (its length >= 1), no FP8 keys with a bf16 query",
    "tmo.smooth_quant_group_gemm": "int8_gemm / int8_grouped_gemm (per-token x per-channel scales) and, on FP8 MLUs, "
                                   "fp8_block_gemm / fp8_grouped_gemm (its a_groupwise-b_per_block mode: N a multiple "
                                   "of 128); half/bfloat16 out only; no float32 bias",
    "torch_mlu_ops version": "1.12.1 only (the one public release; chips.TMO_API)",
    "sparse_mla_decode_paged (BANG C)": f"Dqk <= {_DECODE.max_dqk}, H <= {_DECODE.max_heads}",
}


def _tmo_declined(backend: "CambriconBackend") -> str | None:
    """Every tmo call follows the one public torch_mlu_ops version (chips.TMO_API)."""
    return backend.unverified("tmo_api")


# -- shared conversions ------------------------------------------------------------------------
_TURN_BITS = 62                      # a turn is 2^62 in the fixed-point angles below
_LOW31 = (1 << 31) - 1
_turns_per_position: dict[tuple, tuple[Tensor, Tensor]] = {}


def _frequency_turns(rot: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """theta^(-2i/rot) / (2 pi), turns per position of pair i, as a 62-bit fraction split in
    its high and low 31 bits (int64 [rot/2] each), made once per (rot, theta, device) from host
    constants."""
    key = (rot, float(theta), str(device))
    if key not in _turns_per_position:
        fixed = [round(math.pow(float(theta), -2.0 * i / rot) / (2 * math.pi) * 2.0 ** _TURN_BITS)
                 for i in range(rot // 2)]
        _turns_per_position[key] = (torch.tensor([f >> 31 for f in fixed], dtype=_I64, device=device),
                                    torch.tensor([f & _LOW31 for f in fixed], dtype=_I64, device=device))
    return _turns_per_position[key]


def rotary_tables(positions: Tensor, rot: int, theta: float, interleaved: bool,
                  device: torch.device) -> tuple[Tensor, Tensor]:
    """float32 [T, rot] sin and cos tables, one row per token (row t for positions[t]),
    laid out as tmo.apply_rotary reads them: each angle repeated over its pair for the
    interleaved mode, the two halves for the folded one.

    The angle p * f_i is reduced modulo a turn exactly, in int64 fixed point on the device:
    (p * F_i) mod 2^62 with F_i = f_i / (2 pi) * 2^62, the product split over F_i's two 31-bit
    halves so that nothing overflows for |p| < 2^32; only the reduced fraction is rounded to
    float32 and turned into radians in [-pi, pi). A float32 angle p * f_i is off by up to
    |p| * 2^-24 rad (0.008 rad at p = 131072), far beyond the op's float32 tolerance; float64 on
    an MLU is UNVERIFIED, and forming angles on the host would copy the positions back."""
    high, low = _frequency_turns(rot, theta, device)
    p = positions.to(_I64)[:, None]   # on the device already (the contract puts every input there)
    mask = (1 << _TURN_BITS) - 1
    turns = ((((p * high[None, :]) & _LOW31) << 31) + ((p * low[None, :]) & mask)) & mask
    centred = torch.where(turns >= (1 << (_TURN_BITS - 1)), turns - (1 << _TURN_BITS), turns)
    angles = centred.to(_F32) * (2.0 * math.pi * 2.0 ** -_TURN_BITS)
    sin, cos = angles.sin(), angles.cos()
    if interleaved:
        sin, cos = sin.repeat_interleave(2, dim=-1), cos.repeat_interleave(2, dim=-1)
    else:
        sin, cos = torch.cat((sin, sin), dim=-1), torch.cat((cos, cos), dim=-1)
    return sin.contiguous(), cos.contiguous()


def scatter_to_slots(y: Tensor, src: Tensor, slots: int) -> Tensor:
    """[slots, D]: row src[r] holds y[r], slots without a row hold 0 (tmo's combine reads one
    row per (token, slot) pair in flat order)."""
    out = y.new_zeros(slots, y.shape[1])
    out[src.long()] = y
    return out


def _as_bytes(t: Tensor) -> Tensor:
    """FP8 tensors as their int8 bytes: tmo's copy ops list int8 but not float8 (a copy is
    exact either way)."""
    return t.view(_I8) if t.dtype == _FP8 else t


# -- common ------------------------------------------------------------------------------------
def rms_norm_supported(backend: "CambriconBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return _tmo_declined(backend) or weight_cast_declined(x, weight, "tmo.fused_rms_norm takes gamma") or True


def rms_norm(backend: "CambriconBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    gamma = weight.to(x.dtype).contiguous()
    out = backend.runtime.tmo.fused_rms_norm(rows, None, gamma, None, None, float(eps), False)
    return out.view(x.shape)


def silu_and_mul_supported(backend: "CambriconBackend", x: Tensor) -> Verdict:
    return _tmo_declined(backend) or True


def silu_and_mul(backend: "CambriconBackend", x: Tensor) -> Tensor:
    out_shape = (*x.shape[:-1], x.shape[-1] // 2)
    if x.numel() == 0:
        return x.new_empty(out_shape)
    # tmo.active with is_gated: act(x[..., :C//2]) * x[..., C//2:] -- the contract's [gate, up]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return backend.runtime.tmo.active(rows, "silu", True).view(out_shape)


def apply_rope_supported(backend: "CambriconBackend", x: Tensor, positions: Tensor, theta: float,
                         interleaved: bool) -> Verdict:
    if _tmo_declined(backend):
        return _tmo_declined(backend)
    if x.shape[2] > ROTARY_MAX_HEAD_SIZE:
        return f"tmo.apply_rotary takes head_size <= {ROTARY_MAX_HEAD_SIZE}, got a rotary dim of {x.shape[2]}"
    return True


def apply_rope(backend: "CambriconBackend", x: Tensor, positions: Tensor, theta: float, interleaved: bool) -> Tensor:
    tokens, _, rot = x.shape
    if x.numel() == 0:
        return torch.empty_like(x)
    sin, cos = rotary_tables(positions, rot, theta, interleaved, x.device)
    # One table row per token, so position_ids is simply 0..T-1 (discrete mode) and any
    # position, negative ones included (the backward rotates by -positions), works.
    row_ids = torch.arange(tokens, dtype=_I32, device=x.device)
    cu_seqlens = torch.arange(2, dtype=_I32, device=x.device) * tokens   # [0, T], made on the device
    xf = x.to(_F32).contiguous()
    out = torch.empty_like(xf)
    backend.runtime.tmo.apply_rotary(xf, sin, cos, row_ids, cu_seqlens, interleaved, True, False, tokens,
                                     output=out)
    return out.to(x.dtype)


# -- MoE ---------------------------------------------------------------------------------------
def moe_route_supported(backend: "CambriconBackend", logits, bias, top_k, n_group, topk_group, routed_scaling_factor,
                        norm_topk_prob, score_func) -> Verdict:
    if _tmo_declined(backend):
        return _tmo_declined(backend)
    if score_func == "softmax" and n_group > 1:
        return ("tmo.moe_softmax_topk scores an expert group by its best expert (the contract: by its "
                "best two) and masks dropped groups with 0, not -inf")
    if score_func == "sigmoid" and norm_topk_prob:
        return first_reason(lambda: sigmoid_underflow(logits, "tmo.moe_sigmoid_topk"))
    return True


def moe_route(backend: "CambriconBackend", logits: Tensor, bias: Tensor | None, top_k: int, n_group: int,
              topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool,
              score_func: str) -> tuple[Tensor, Tensor]:
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


def moe_permute_supported(backend: "CambriconBackend", x: Tensor, ids: Tensor, num_experts: int) -> Verdict:
    return _tmo_declined(backend) or True


def moe_permute(backend: "CambriconBackend", x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    if ids.numel() == 0:
        return no_permuted_rows(x, ids, num_experts)
    tmo = backend.runtime.tmo
    # moe_gen_idx wants every id in [0, expert_num): the dropped ones go to a spare expert,
    # whose rows moe_expand_input's [start_expert_id, start_expert_id + expert_size) range
    # leaves out.
    expert_id, expert_num = spare_expert_ids(ids, num_experts)
    expand_idx, combine_idx, token_count, cusum = tmo.moe_gen_idx(expert_id, expert_num)[:4]
    rows = int(cusum[num_experts])   # the output size is the data: the op's one host read
    x_perm = tmo.moe_expand_input(x.contiguous(), expand_idx, cusum, 0, num_experts)[:rows]
    # combine_idx maps flat slot -> row
    return permuted_in_contract_order(x_perm, combine_idx, token_count[:num_experts].to(_I32))


def moe_unpermute_supported(backend: "CambriconBackend", y: Tensor, src: Tensor, weights: Tensor) -> Verdict:
    return (_tmo_declined(backend)
            or repeated_slot(src, weights.shape[0] * weights.shape[1], "tmo.moe_combine_result") or True)


def moe_unpermute(backend: "CambriconBackend", y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    tokens, k = weights.shape
    if tokens == 0:
        return y.new_zeros((0, y.shape[1]))
    slots = tokens * k
    gather_ids = torch.arange(slots, dtype=_I32, device=y.device)
    return backend.runtime.tmo.moe_combine_result(
        scatter_to_slots(y, src, slots), weights.contiguous(), gather_ids, None, None, 0, 0)


def grouped_gemm_supported(backend: "CambriconBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Verdict:
    if _tmo_declined(backend):
        return _tmo_declined(backend)
    if x.dtype == _F32 and _tf32_enabled(backend.runtime.backends):
        return ("tmo.group_gemm would run this float32 GEMM in TF32 "
                "(torch.backends.mlu.matmul.fp32_precision is 'tf32')")
    return True


def grouped_gemm(backend: "CambriconBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
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
def kv_cache_write_supported(backend: "CambriconBackend", cache: Tensor, values: Tensor,
                             slot_mapping: Tensor) -> Verdict:
    return (_tmo_declined(backend) or int32_slots_declined(cache, "tmo.reshape_paged_cache")
            or paged_view_declined("tmo.reshape_paged_cache", cache) or True)


def kv_cache_write(backend: "CambriconBackend", cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    write_key_rows(backend.runtime.tmo.reshape_paged_cache, _as_bytes(cache), _as_bytes(values), slot_mapping)


def kv_cache_gather_supported(backend: "CambriconBackend", cache: Tensor, block_table: Tensor,
                              context_lens: Tensor) -> Verdict:
    if _tmo_declined(backend):
        return _tmo_declined(backend)
    if not cache.is_contiguous():
        return ("tmo.reshape_from_cache reads a contiguous paged cache; this one is a strided view "
                "(copying it would cost a whole-cache copy per call)")
    return True


def kv_cache_gather(backend: "CambriconBackend", cache: Tensor, block_table: Tensor, context_lens: Tensor) -> Tensor:
    blocks, block_size, dim = cache.shape
    total = int(context_lens.sum()) if context_lens.numel() else 0   # the output size is the data: one host read
    out = cache.new_empty((total, dim))
    if total == 0:
        return out
    # max_context_len only has to bound the lengths: every sequence fits its block-table row
    bound = block_table.shape[1] * block_size
    backend.runtime.tmo.reshape_from_cache(
        _as_bytes(out).view(total, 1, dim), None, _as_bytes(cache).view(blocks, 1, block_size, dim), None,
        context_lens.contiguous(), bound, None, block_table.contiguous(), None)
    return out


def indexer_k_cache_write_supported(backend: "CambriconBackend", k: Tensor, k_cache: Tensor, k_scale: Tensor,
                                    slot_mapping: Tensor, scale_fmt: str | None) -> Verdict:
    return first_reason(lambda: _tmo_declined(backend), backend.fp8_declined,
                        lambda: int32_slots_declined(k_cache, "tmo.reshape_paged_cache"),
                        lambda: paged_view_declined("tmo.reshape_paged_cache", k_cache, k_scale))


def indexer_k_cache_write(backend: "CambriconBackend", k: Tensor, k_cache: Tensor, k_scale: Tensor,
                          slot_mapping: Tensor, scale_fmt: str | None) -> None:
    """Each key row is quantised as one FP8 block on the device, by the contract's rule (scale
    max(amax, 1e-4) / 448, ue8m0 rounding when asked), then rows and scales are written with
    tmo.reshape_paged_cache, which skips -1 slots (its docstring's Math). The fused
    tmo.quant_to_paged_cache is not used: it has no scale floor and no ue8m0 scales, and its
    docstring does not say it skips -1 slots -- all three would need a host read to decline."""
    tokens, dim = k.shape
    if tokens == 0:
        return None
    blocks, block_size, _ = k_cache.shape
    kf = k.float()
    scale = kf.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_MIN_AMAX) / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (kf / scale).clamp(-FP8_MAX, FP8_MAX).to(_FP8)
    slots = slot_mapping.to(_I32).contiguous()
    tmo = backend.runtime.tmo
    tmo.reshape_paged_cache(_as_bytes(q).view(tokens, 1, dim), None,
                            _as_bytes(k_cache).view(blocks, 1, block_size, dim), None, slots)
    tmo.reshape_paged_cache(scale.to(k_scale.dtype).view(tokens, 1, 1), None,
                            k_scale.view(blocks, 1, block_size, 1), None, slots)
    return None


# -- DSA ---------------------------------------------------------------------------------------
def indexer_topk_paged_supported(backend: "CambriconBackend", q, k_cache, weights, block_table, context_lens,
                                 topk) -> Verdict:
    if _tmo_declined(backend):
        return _tmo_declined(backend)
    if isinstance(k_cache, (tuple, list)):
        return ("FP8 keys: tmo.masked_indexer_select_paged_kv takes a quantised key cache together with a "
                "quantised query (q_scale); quantising the bf16/fp16 query would change the scores")
    batch, queries, heads, dim = q.shape
    if dim != INDEXER_DIM:
        return f"tmo.masked_indexer_select_paged_kv needs head_size {INDEXER_DIM}, got {dim}"
    if heads > INDEXER_HEADS[-1]:
        return f"tmo.masked_indexer_select_paged_kv takes at most {INDEXER_HEADS[-1]} heads, got {heads}"
    return True


def indexer_topk_paged(backend: "CambriconBackend", q: Tensor, k_cache: Tensor, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    """Each (sequence, query) is one decode row of the vendor op: query i of N sees the keys
    [0, context_len - N + i + 1), so that row's k_context_len is that count. The op wants "the
    real length of Q not greater than the real length of K", i.e. at least one key: rows that
    see none get length 1 over block 0 (always a real block: their own table may hold none)
    and every entry masked to -1 afterwards, on the device."""
    batch, queries, heads, dim = q.shape
    if batch == 0 or queries == 0 or k_cache.shape[0] == 0:   # no cache blocks: no context has keys
        return q.new_full((batch, queries, topk), -1, dtype=_I32)
    rows = batch * queries
    padded = INDEXER_HEADS[0] if heads <= INDEXER_HEADS[0] else INDEXER_HEADS[1]
    # Extra heads get weight 0: relu(q.k) * 0 adds nothing to a logit.
    q_in = pad_heads(q, padded, dim=2).view(rows, 1, padded, dim)
    w_in = pad_heads(weights, padded, dim=2).view(rows, 1, padded, 1)
    blocks, block_size, _ = k_cache.shape
    visible = (context_lens.to(_I32)[:, None] - queries + 1
               + torch.arange(queries, dtype=_I32, device=q.device)[None, :]).reshape(rows)
    lengths = visible.clamp(min=1).contiguous()
    table = block_table.to(_I32).repeat_interleave(queries, dim=0)
    table = torch.where((visible > 0)[:, None], table, 0).contiguous()
    # With kv_cache_block_size 1 the op returns kv_cache_block_table[selected]: a table of
    # 0..L-1 (L bounds every context: a block-table row's capacity, read from the shapes, not
    # the data) turns that into the logical positions the contract returns.
    longest = max(block_table.shape[1] * block_size, 1)
    positions = torch.arange(longest, dtype=_I32, device=q.device).expand(rows, longest).contiguous()
    selected, counts = backend.runtime.tmo.masked_indexer_select_paged_kv(
        q_in, k_cache.view(blocks, 1, block_size, dim), w_in, positions, None, None,
        lengths, table, False, topk, 1, 1.0, is_score_float=True)
    valid = torch.arange(topk, device=q.device) < torch.minimum(counts.view(rows, 1), visible.view(rows, 1))
    return torch.where(valid, selected.view(rows, topk), -1).to(_I32).view(batch, queries, topk)


# -- the checkpoints' quantized GEMMs: tmo.smooth_quant_group_gemm ----------------------------------
_QBLOCK = 128   # the FP8 checkpoints' block (glm5_hal.reference.quant.FP8_GEMM_BLOCK)


def _sq_declined(backend: "CambriconBackend", out_dtype: torch.dtype) -> str | None:
    return _tmo_declined(backend) or (
        None if out_dtype in HALVES else
        f"tmo.smooth_quant_group_gemm writes half or bfloat16 only (its dtype argument), not {dtype_name(out_dtype)}")


def _sq_gemm(backend: "CambriconBackend", a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, counts: Tensor,
             out_dtype: torch.dtype) -> Tensor:
    """smooth_quant_group_gemm(a, b [E, N, K], m_list, None, None, None, None, a_scale, b_scale,
    dtype, max_m), as vllm-mlu's W8A8 MoE calls it (vllm_mlu/_mlu_ops.py @8fa99fd9); max_m only has
    to bound the counts (its docstring asks for "the theoretical maximum"): the row count does,
    without reading them."""
    rows, cols = a.shape[0], b.shape[1]
    if rows == 0 or cols == 0 or a.shape[1] == 0:   # nothing to multiply: the contract's zeros
        return a.new_zeros((rows, cols), dtype=out_dtype)
    return backend.runtime.tmo.smooth_quant_group_gemm(
        a.contiguous(), b.contiguous(), counts.to(_I32).contiguous(), None, None, None, None, a_scale.contiguous(),
        b_scale.contiguous(), out_dtype, rows)


def int8_gemm_supported(backend: "CambriconBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                        out_dtype: torch.dtype, bias: Tensor | None) -> Verdict:
    return first_reason(
        lambda: _sq_declined(backend, out_dtype),
        lambda: None if bias is None else
        "tmo.smooth_quant_group_gemm takes its bias in half/bfloat16 (Type: bias): the float32 bias would round "
        "before it is added")


def int8_gemm(backend: "CambriconBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
              out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """One expert holding every row (Math: d_i = matmul(a_i, b[i]) * outer(a_scale_i, b_scale[i]))."""
    counts = torch.full((1,), x.shape[0], dtype=_I32, device=x.device)
    return _sq_gemm(backend, x, x_scale, w.unsqueeze(0), w_scale.unsqueeze(0), counts, out_dtype)


def int8_grouped_gemm_supported(backend: "CambriconBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                                tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Verdict:
    return _sq_declined(backend, out_dtype) or True


def int8_grouped_gemm(backend: "CambriconBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                      tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Tensor:
    return _sq_gemm(backend, x, x_scale, w, w_scale, tokens_per_expert, out_dtype)


def _fp8_block_declined(backend: "CambriconBackend", n: int, out_dtype: torch.dtype) -> str | None:
    return (_sq_declined(backend, out_dtype) or backend.fp8_declined()
            or (None if n % _QBLOCK == 0 else
                f"tmo.smooth_quant_group_gemm's per-block FP8 mode needs N a whole number of blocks (n_block * "
                f"n_block_size == n), got N = {n}"))


def fp8_block_gemm_supported(backend: "CambriconBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                             out_dtype: torch.dtype) -> Verdict:
    return _fp8_block_declined(backend, w.shape[0], out_dtype) or True


def fp8_block_gemm(backend: "CambriconBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                   out_dtype: torch.dtype) -> Tensor:
    """The a_groupwise-b_per_block mode: a_scale as (k_block, total_m), b_scale (experts, n_block,
    k_block) (the docstring's Args; its Math shows only the per-token mode: the per-block product
    is inferred, UNVERIFIED beyond the emulator)."""
    counts = torch.full((1,), a.shape[0], dtype=_I32, device=a.device)
    return _sq_gemm(backend, a, a_scale.transpose(0, 1), w.unsqueeze(0), w_scale.unsqueeze(0), counts, out_dtype)


def fp8_grouped_gemm_supported(backend: "CambriconBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                               tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Verdict:
    return _fp8_block_declined(backend, w.shape[1], out_dtype) or True


def fp8_grouped_gemm(backend: "CambriconBackend", a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                     tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Tensor:
    return _sq_gemm(backend, a, a_scale.transpose(0, 1), w, w_scale, tokens_per_expert, out_dtype)


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS, supports_metadata=rms_norm_supported),
    Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS, supports_metadata=silu_and_mul_supported),
    Adapter("apply_rope", apply_rope, dtypes=FLOATS, supports_metadata=apply_rope_supported),
    # per call: sigmoid underflow is a data check on the logits
    Adapter("moe_route", moe_route, dtypes=FLOATS, supports=moe_route_supported),
    Adapter("moe_permute", moe_permute, dtypes=FLOATS, supports_metadata=moe_permute_supported),
    # per call: a repeated (token, slot) in src is a data check
    Adapter("moe_unpermute", moe_unpermute, dtypes=FLOATS, supports=moe_unpermute_supported),
    # per call: torch.backends.mlu's TF32 switch can change between calls
    Adapter("grouped_gemm", grouped_gemm, dtypes=FLOATS, supports=grouped_gemm_supported),
    # per call: reads the cache's contiguity (the call key holds only whether it is paged)
    Adapter("kv_cache_write", kv_cache_write, dtypes=FLOATS + (_FP8,), supports=kv_cache_write_supported),
    # per call: reads the cache's contiguity, which the call key does not hold
    Adapter("kv_cache_gather", kv_cache_gather, dtypes=FLOATS + (_FP8,), supports=kv_cache_gather_supported),
    # per call: reads the caches' contiguity (the call key holds only whether they are paged)
    Adapter("indexer_k_cache_write", indexer_k_cache_write, dtypes=FLOATS, supports=indexer_k_cache_write_supported),
    Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=HALVES, supports_metadata=indexer_topk_paged_supported),
    Adapter("int8_gemm", int8_gemm, dtypes=(_I8,), supports_metadata=int8_gemm_supported),
    Adapter("int8_grouped_gemm", int8_grouped_gemm, dtypes=(_I8,), supports_metadata=int8_grouped_gemm_supported),
    Adapter("fp8_block_gemm", fp8_block_gemm, dtypes=(_FP8,), supports_metadata=fp8_block_gemm_supported),
    Adapter("fp8_grouped_gemm", fp8_grouped_gemm, dtypes=(_FP8,), supports_metadata=fp8_grouped_gemm_supported),
    SPARSE_MLA_DECODE_PAGED,   # the BANG C kernel (kernels.py)
)
