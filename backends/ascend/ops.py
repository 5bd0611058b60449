"""Adapters from glm5_hal's canonical ops to torch_npu's fused ops.

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
AscendBackend instance binds to itself; it reaches the vendor through `backend.runtime` (the
real `torch_npu`, or an emulator in tests), so several instances coexist. Inputs arrive
validated by glm5_hal.ops; an adapter converts layouts and index conventions, calls the
vendor op and returns exactly the canonical outputs. Each `supports()` checks the vendor's
documented per-call constraints and returns a reason when the call falls outside them, so
dispatch moves on instead of the vendor op failing on the device. README.md has the table of what maps to what, and why.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from glm5_hal.vendor_backend import (Adapter, Verdict, first_reason, no_permuted_rows, pad_heads, rope_angles,
                                     weight_cast_declined)

if TYPE_CHECKING:
    from . import AscendBackend

_F32, _F16, _BF16, _I32, _I64 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64
_FP8 = torch.float8_e4m3fn
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

# -- vendor constraints (torch_npu 2.13.0 docs; see README.md) ---------------------------------
INDEXER_HEADS = 64                                   # npu_lightning_indexer: N1 only 64
INDEXER_DIM = 128                                    # ... D only 128
INDEXER_LARGE_COUNTS = (3072, 4096, 5120, 6144, 7168, 8192)  # sparse_count beyond 1..2048
PAGED_BLOCK_MULTIPLE, PAGED_BLOCK_MAX = 16, 1024     # PA_BSND block_size
SFA_NOPE, SFA_ROPE = 512, 64                         # npu_sparse_flash_attention: D = 512 + 64
SFA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)            # ... N1
GATING_MAX_EXPERTS = 2048                            # npu_moe_gating_top_k
ROUTING_MAX_EXPERT_NUM = 10240                       # npu_moe_init_routing_v2 expert_num
GMM_MAX_GROUPS, GMM_MAX_LAST_DIM = 1024, 65536       # npu_grouped_matmul, one 3-D weight
ROTARY_MAX_HEADS, ROTARY_HALF_MAX_DIM = 1000, 896    # npu_rotary_mul
BLOCK_QUANT_COLS = 128                               # npu_dynamic_block_quant col_block_size
FP8_MAX, FP8_MIN_AMAX = 448.0, 1e-4                  # the fp8_block_quant contract
HADAMARD_MIN_DIM, HADAMARD_MAX_DIM = 16, 8192        # csrc/glm5_hal_ascend.h

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "npu_rms_norm": "gamma in x's dtype (fp32 x casts its weight exactly)",
    "npu_lightning_indexer": f"N1 = {INDEXER_HEADS} (fewer heads are zero-padded), D = {INDEXER_DIM}, one key "
                             f"head, bf16/fp16, sparse_count 1-2048 or {INDEXER_LARGE_COUNTS}, PA_BSND "
                             f"block_size a multiple of {PAGED_BLOCK_MULTIPLE} up to {PAGED_BLOCK_MAX}",
    "npu_sparse_flash_attention": f"MLA-absorb only: D = {SFA_NOPE} + {SFA_ROPE}, one KV head, N1 in {SFA_HEADS} "
                                  "(other head counts are chunked and zero-padded), bf16/fp16",
    "npu_moe_gating_top_k": f"E <= {GATING_MAX_EXPERTS}, more than 2 experts per group, sigmoid scores "
                            "always renormalised",
    "npu_moe_init_routing_v2": f"expert_num <= {ROUTING_MAX_EXPERT_NUM} (the adapter uses num_experts + 1)",
    "npu_grouped_matmul": f"<= {GMM_MAX_GROUPS} experts, last dims < {GMM_MAX_LAST_DIM}",
    "npu_rotary_mul": f"heads < {ROTARY_MAX_HEADS}; half mode R < {ROTARY_HALF_MAX_DIM}",
    "npu_dynamic_block_quant": f"blocks of 1 x {BLOCK_QUANT_COLS}; FP8 output only on Ascend 950; bf16/fp16 input",
    "npu_scatter_nd_update_": "no skipping of out-of-range slots (the adapter drops -1 rows first); FP8 rows "
                              "are written as their int8 bytes",
    "hadamard (Ascend C)": f"D a power of two in [{HADAMARD_MIN_DIM}, {HADAMARD_MAX_DIM}]",
}


# -- shared conversions ------------------------------------------------------------------------
def left_pack(indices: Tensor, valid: Tensor) -> Tensor:
    """Valid entries of each row first, in their original order, then -1: the vendor's
    "valid first, invalid after" convention (the attention kernel stops at the first -1)."""
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    packed = indices.gather(-1, order)
    rank = torch.arange(indices.shape[-1], device=indices.device)
    return torch.where(rank < valid.sum(-1, keepdim=True), packed, -1).to(_I32)


def indexer_sparse_count(topk: int) -> int | None:
    """The smallest sparse_count the indexer accepts that is >= topk (None: none is). The
    indexer sorts by score with a -1 tail, so the first topk of a larger count are the top-k."""
    if topk <= 2048:
        return topk
    return next((c for c in INDEXER_LARGE_COUNTS if c >= topk), None)


def prefix_sums(lengths: list[int], device: torch.device) -> Tensor:
    return torch.tensor(lengths, dtype=_I64).cumsum(0).to(_I32).to(device)


def head_chunks(heads: int) -> list[tuple[int, int, int]]:
    """(first, end, padded) head ranges: chunks of at most 128 heads, each padded up to a
    head count npu_sparse_flash_attention accepts (heads are independent in attention)."""
    chunks = []
    for first in range(0, heads, SFA_HEADS[-1]):
        end = min(first + SFA_HEADS[-1], heads)
        chunks.append((first, end, next(n for n in SFA_HEADS if n >= end - first)))
    return chunks


# -- common ------------------------------------------------------------------------------------
def rms_norm_supported(backend: "AscendBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return weight_cast_declined(x, weight, "npu_rms_norm takes gamma") or True


def rms_norm(backend: "AscendBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    # npu_rms_norm wants 2-8 dims and normalises over gamma's dims: [rows, D] covers all.
    rows = x.reshape(-1, x.shape[-1])
    y, _rstd = backend.runtime.npu_rms_norm(rows, weight.to(x.dtype), epsilon=float(eps))
    return y.view(x.shape)


def silu_and_mul(backend: "AscendBackend", x: Tensor) -> Tensor:
    out_shape = (*x.shape[:-1], x.shape[-1] // 2)
    if x.numel() == 0:
        return x.new_empty(out_shape)
    # npu_swiglu: swish(A) * B with A the first half, as the contract's [gate, up]
    return backend.runtime.npu_swiglu(x.reshape(-1, x.shape[-1]), dim=-1).view(out_shape)


def apply_rope_supported(backend: "AscendBackend", x: Tensor, positions: Tensor, theta: float,
                         interleaved: bool) -> Verdict:
    heads, rot = x.shape[1], x.shape[2]
    if heads >= ROTARY_MAX_HEADS:
        return f"npu_rotary_mul needs B*N < {ROTARY_MAX_HEADS}, got {heads} heads"
    if not interleaved and rot >= ROTARY_HALF_MAX_DIM:
        return f"npu_rotary_mul's half mode needs D < {ROTARY_HALF_MAX_DIM}, got {rot}"
    return True


def apply_rope(backend: "AscendBackend", x: Tensor, positions: Tensor, theta: float, interleaved: bool) -> Tensor:
    tokens, heads, rot = x.shape
    if x.numel() == 0:
        return torch.empty_like(x)
    angles = rope_angles(positions, rot, theta)
    cos, sin = angles.cos(), angles.sin()
    # npu_rotary_mul takes cos/sin over the full D: pair-repeated for 'interleave',
    # the two halves for 'half'. Float32 throughout: cos/sin rounded to bf16 would
    # miss the contract near cancellations (a cos - b sin ~ 0).
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    out = backend.runtime.npu_rotary_mul(
        x.to(_F32).reshape(1, tokens, heads, rot), cos.view(1, tokens, 1, rot), sin.view(1, tokens, 1, rot),
        rotary_mode="interleave" if interleaved else "half")
    return out.view(tokens, heads, rot).to(x.dtype)


def hadamard_transform_supported(backend: "AscendBackend", x: Tensor, scale: float) -> Verdict:
    dim = x.shape[-1]
    return first_reason(
        backend.kernels.missing,
        lambda: None if HADAMARD_MIN_DIM <= dim <= HADAMARD_MAX_DIM else
        f"the Ascend C Hadamard kernel takes D in [{HADAMARD_MIN_DIM}, {HADAMARD_MAX_DIM}], got {dim}")


def hadamard_transform(backend: "AscendBackend", x: Tensor, scale: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    with backend.runtime.npu.device(x.device):  # the host glue launches on the current device
        backend.kernels.hadamard(rows, out, scale, backend.stream(x.device))
    return out.view(x.shape)


# -- quant -------------------------------------------------------------------------------------
def fp8_block_quant_supported(backend: "AscendBackend", x: Tensor, block: int, scale_fmt: str | None) -> Verdict:
    return first_reason(
        backend.fp8_declined,
        lambda: None if block == BLOCK_QUANT_COLS else
        f"npu_dynamic_block_quant quantises blocks of {BLOCK_QUANT_COLS} columns only, got block {block}",
        lambda: None if scale_fmt is None else
        "npu_dynamic_block_quant has no power-of-two (ue8m0) scale option")


def fp8_block_quant(backend: "AscendBackend", x: Tensor, block: int, scale_fmt: str | None) -> tuple[Tensor, Tensor]:
    cols = x.shape[-1]
    scale_shape = (*x.shape[:-1], cols // block)
    if x.numel() == 0:
        return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
                x.new_empty(scale_shape, dtype=_F32))
    # min_scale floors scale = blockmax / 448 at the contract's amax floor 1e-4 / 448
    q, scale = backend.runtime.npu_dynamic_block_quant(
        x.reshape(-1, cols).contiguous(), min_scale=FP8_MIN_AMAX / FP8_MAX, dst_type=torch.float8_e4m3fn,
        row_block_size=1, col_block_size=BLOCK_QUANT_COLS)
    return q.view(x.shape), scale.reshape(scale_shape)


# -- DSA ---------------------------------------------------------------------------------------
def _indexer_declined(q: Tensor, k: object, topk: int) -> str | None:
    if isinstance(k, (tuple, list)):
        return ("npu_lightning_indexer takes bf16/fp16 keys; FP8 key pairs would need "
                "npu_quant_lightning_indexer, which also quantises q (not adapted)")
    heads, dim = q.shape[-2], q.shape[-1]
    if heads > INDEXER_HEADS:
        return f"npu_lightning_indexer runs exactly {INDEXER_HEADS} query heads (N1); {heads} heads do not fit"
    if dim != INDEXER_DIM:
        return f"npu_lightning_indexer needs head dim D = {INDEXER_DIM}, got {dim}"
    if indexer_sparse_count(topk) is None:
        return (f"npu_lightning_indexer returns at most {INDEXER_LARGE_COUNTS[-1]} positions "
                f"(sparse_count 1-2048 or {INDEXER_LARGE_COUNTS}), topk is {topk}")
    return None


def _attention_declined(q: Tensor, d_v: int) -> str | None:
    dqk = q.shape[-1]
    if dqk != SFA_NOPE + SFA_ROPE:
        return (f"npu_sparse_flash_attention runs MLA-absorb mode only: Dqk = {SFA_NOPE} + {SFA_ROPE}, "
                f"got {dqk}")
    if d_v > SFA_NOPE:
        return f"npu_sparse_flash_attention returns the {SFA_NOPE} latent dims, d_v {d_v} is larger"
    return None


def _indexer_weights(q: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """q and weights with the heads zero-padded to 64 (a zero-weight head adds nothing to
    sum_h w_h relu(q_h . k)); weights in q's dtype, which the indexer requires (exact: see
    _weights_declined)."""
    return pad_heads(q, INDEXER_HEADS, -2), pad_heads(weights.to(q.dtype), INDEXER_HEADS, -1)


def causal_runs(starts: list[int], ends: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Splits per-token key ranges [starts[t], ends[t]) into runs (first, end, key_start,
    key_len, sparse_mode) of consecutive tokens that npu_lightning_indexer computes as one
    TND batch: a causal run (sparse_mode 3: same start, end growing by one per token, i.e.
    bottom-right aligned) or a flat run (sparse_mode 0: the same range for every token).
    Tokens with an empty range belong to no run: their row is all -1 without a call."""
    runs: list[list[int]] = []
    for t, (s, e) in enumerate(zip(starts, ends)):
        if e <= s:
            continue
        if runs and runs[-1][1] == t and s == runs[-1][2]:
            run = runs[-1]
            causal = e == ends[t - 1] + 1 and run[4] in (-1, 3)
            flat = e == ends[t - 1] and run[4] in (-1, 0)
            if causal or flat:
                run[1], run[3], run[4] = t + 1, e - s, 3 if causal else 0
                continue
        runs.append([t, t + 1, s, e - s, -1])
    return [(a, b, ks, kl, 3 if mode == -1 else mode) for a, b, ks, kl, mode in runs]


def _weights_declined(q: Tensor, weights: Tensor) -> str | None:
    """npu_lightning_indexer takes the head weights in q's dtype. Rounding our float32
    weights would move scores by up to 2^-9 relative and reorder near-tied keys beyond the
    contract's top-k tolerance (the conformance suite caught exactly that), so only weights
    that survive the cast unchanged go to the vendor op. A data check on [T, Hi]: cheap."""
    if not torch.equal(weights.to(q.dtype).to(weights.dtype), weights):
        return (f"npu_lightning_indexer takes weights in q's dtype ({str(q.dtype)[6:]}); these float32 "
                f"weights are not exactly representable in it (rounding would reorder the top-k)")
    return None


def indexer_topk_supported(backend: "AscendBackend", q, k, weights, k_start, k_end, topk) -> Verdict:
    return _indexer_declined(q, k, topk) or _weights_declined(q, weights) or True


def indexer_topk(backend: "AscendBackend", q: Tensor, k: Tensor, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    tokens, device = q.shape[0], q.device
    out = torch.full((tokens, topk), -1, dtype=_I32, device=device)
    runs = causal_runs(k_start.tolist(), k_end.tolist())  # a host sync, like the kernel's lengths
    if not runs:
        return out
    q64, w64 = _indexer_weights(q, weights)
    count = indexer_sparse_count(topk)
    for mode in (3, 0):  # the mask mode is per call: one call per kind of run
        group = [r for r in runs if r[4] == mode]
        if not group:
            continue
        token_idx = torch.cat([torch.arange(a, b) for a, b, *_ in group]).to(device)
        # TND keys: each run's key range, concatenated. Packed prefill (adjacent ranges)
        # is a slice of k; overlapping or out-of-order ranges are gathered (a copy).
        first_key = group[0][2]
        adjacent = all(r[2] == p[2] + p[3] for p, r in zip(group, group[1:]))
        if adjacent:
            key = k[first_key: first_key + sum(r[3] for r in group)]
        else:
            key = k.index_select(0, torch.cat([torch.arange(ks, ks + kl) for _, _, ks, kl, _ in group]).to(device))
        key = key.contiguous().view(-1, 1, k.shape[-1])
        found, _ = backend.runtime.npu_lightning_indexer(
            q64.index_select(0, token_idx), key, w64.index_select(0, token_idx),
            actual_seq_lengths_query=prefix_sums([b - a for a, b, *_ in group], device),
            actual_seq_lengths_key=prefix_sums([kl for *_, kl, _ in group], device),
            layout_query="TND", layout_key="TND", sparse_count=count, sparse_mode=mode)
        found = found[:, 0, :topk].long()
        offset = torch.cat([torch.full((b - a,), ks, dtype=_I64) for a, b, ks, *_ in group]).to(device)
        out[token_idx] = torch.where(found >= 0, found + offset.unsqueeze(-1), -1).to(_I32)
    return out


def indexer_topk_paged_supported(backend: "AscendBackend", q, k_cache, weights, block_table, context_lens,
                                 topk) -> Verdict:
    reason = _indexer_declined(q, k_cache, topk) or _weights_declined(q, weights)
    if reason:
        return reason
    block_size = k_cache.shape[1]
    if block_size % PAGED_BLOCK_MULTIPLE or block_size > PAGED_BLOCK_MAX:
        return (f"npu_lightning_indexer's PA_BSND cache needs block_size a multiple of "
                f"{PAGED_BLOCK_MULTIPLE} up to {PAGED_BLOCK_MAX}, got {block_size}")
    return True


def indexer_topk_paged(backend: "AscendBackend", q: Tensor, k_cache: Tensor, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    batch, queries = q.shape[0], q.shape[1]
    num_blocks, max_blocks = k_cache.shape[0], block_table.shape[1]
    if batch * queries == 0 or num_blocks == 0 or max_blocks == 0:  # nothing is visible
        return torch.full((batch, queries, topk), -1, dtype=_I32, device=q.device)
    q64, w64 = _indexer_weights(q, weights)
    # table entries past a sequence's blocks are ignored by the contract and never read
    # by the kernel (it does not validate ids); clamped so no garbage id reaches it
    table = block_table.clamp(0, num_blocks - 1).to(_I32).contiguous()
    found, _ = backend.runtime.npu_lightning_indexer(
        q64, k_cache.unsqueeze(2).contiguous(), w64,
        actual_seq_lengths_query=torch.full((batch,), queries, dtype=_I32, device=q.device),
        actual_seq_lengths_key=context_lens.to(_I32).contiguous(), block_table=table,
        layout_query="BSND", layout_key="PA_BSND", sparse_count=indexer_sparse_count(topk), sparse_mode=3)
    return found[:, :, 0, :topk].contiguous()


def _attention(backend: "AscendBackend", q: Tensor, key_rows: Tensor, local: Tensor, kv_lengths: list[int],
               q_lengths: list[int], sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """npu_sparse_flash_attention in MLA-absorb mode over TND query and key batches:
    q [T, H, 576], key_rows [S, 576], local [T, K] left-packed positions within each
    token's batch. Returns (out [T, H, d_v], lse [T, H] float32)."""
    device = q.device
    tokens, heads = q.shape[0], q.shape[1]
    key = key_rows[:, :SFA_NOPE].contiguous().view(-1, 1, SFA_NOPE)
    key_rope = key_rows[:, SFA_NOPE:].contiguous().view(-1, 1, SFA_ROPE)
    indices = local.view(tokens, 1, -1).contiguous()
    cu_q, cu_kv = prefix_sums(q_lengths, device), prefix_sums(kv_lengths, device)
    outs, lses = [], []
    for first, end, padded in head_chunks(heads):
        chunk = q[:, first:end]
        out, softmax_max, softmax_sum = backend.runtime.npu_sparse_flash_attention(
            pad_heads(chunk[..., :SFA_NOPE], padded, 1), key, key, indices, float(sm_scale),
            actual_seq_lengths_query=cu_q, actual_seq_lengths_kv=cu_kv,
            query_rope=pad_heads(chunk[..., SFA_NOPE:], padded, 1), key_rope=key_rope,
            sparse_block_size=1, layout_query="TND", layout_kv="TND", sparse_mode=0, attention_mode=2,
            return_softmax_lse=True)
        outs.append(out[:, : end - first, :d_v])
        # lse = running max + log(sum of exp(z - max)); an empty row has sum 0 -> -inf
        lses.append(softmax_max[0, :, : end - first] + torch.log(softmax_sum[0, :, : end - first]))
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1).to(_F32)
    # the contract's empty row (no valid index) is out 0, whatever the kernel leaves there
    return torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, out).to(q.dtype), lse


def _empty_attention(q: Tensor, d_v: int) -> tuple[Tensor, Tensor]:
    lead = q.shape[:-1]
    return q.new_zeros((*lead, d_v)), torch.full(lead, float("-inf"), dtype=_F32, device=q.device)


def sparse_mla_attention_supported(backend: "AscendBackend", q, kv, indices, sm_scale, d_v) -> Verdict:
    return _attention_declined(q, d_v) or True


def sparse_mla_attention(backend: "AscendBackend", q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                         d_v: int) -> tuple[Tensor, Tensor]:
    tokens, num_keys = q.shape[0], kv.shape[0]
    if tokens == 0 or num_keys == 0:
        return _empty_attention(q, d_v)
    # one TND batch holding every key; sparse_mode 0 so only [0, S) bounds the indices
    local = left_pack(indices, (indices >= 0) & (indices < num_keys))
    return _attention(backend, q, kv, local, [num_keys], [tokens], sm_scale, d_v)


def sparse_mla_decode_paged_supported(backend: "AscendBackend", q, kv_cache, block_table, context_lens, indices,
                                      sm_scale, d_v) -> Verdict:
    return _attention_declined(q, d_v) or True


def sparse_mla_decode_paged(backend: "AscendBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                            context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    batch, queries, heads, dqk = q.shape
    topk = indices.shape[-1]
    block_size = kv_cache.shape[1]
    valid = (indices >= 0) & (indices < context_lens.view(-1, 1, 1))
    if batch * queries == 0 or kv_cache.shape[0] == 0 or not bool(valid.any()):
        return _empty_attention(q, d_v)
    # Gather each token's selected rows into its own TND batch: with the vendor's PA_BSND
    # path the kernel cannot return the lse (training-only, not with PA), and it would
    # need the canonical [.., 576] cache split into two contiguous caches (a full copy).
    pos = torch.where(valid, indices.long(), 0)
    blocks = block_table.long().gather(1, (pos // block_size).view(batch, -1)).view(pos.shape)
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    rows = kv_cache.reshape(-1, dqk)[slots.view(-1)]                        # [B*N*K, 576]
    tokens = batch * queries
    ranks = torch.arange(topk, device=q.device).expand(tokens, topk)
    local = left_pack(ranks, valid.view(tokens, topk))
    out, lse = _attention(backend, q.reshape(tokens, heads, dqk), rows, local, [topk] * tokens, [1] * tokens,
                         sm_scale, d_v)
    return out.view(batch, queries, heads, d_v), lse.view(batch, queries, heads)


# -- MoE ---------------------------------------------------------------------------------------
def moe_route_supported(backend: "AscendBackend", logits, bias, top_k, n_group, topk_group, routed_scaling_factor,
                        norm_topk_prob, score_func) -> Verdict:
    experts = logits.shape[1]
    per_group = experts // n_group
    if score_func == "sigmoid" and not norm_topk_prob:
        return ("npu_moe_gating_top_k always renormalises sigmoid scores (norm_type 1); "
                "norm_topk_prob=False is not expressible")
    if experts > GATING_MAX_EXPERTS:
        return f"npu_moe_gating_top_k takes at most {GATING_MAX_EXPERTS} experts, got {experts}"
    if per_group <= 2:
        return f"npu_moe_gating_top_k needs more than 2 experts per group, got {per_group}"
    if -(-per_group // 32) * 32 * n_group > GATING_MAX_EXPERTS:
        return (f"npu_moe_gating_top_k needs Align32(E / n_group) * n_group <= {GATING_MAX_EXPERTS}, "
                f"got {-(-per_group // 32) * 32 * n_group}")
    return True


def moe_route(backend: "AscendBackend", logits: Tensor, bias: Tensor | None, top_k: int, n_group: int, topk_group: int,
              routed_scaling_factor: float, norm_topk_prob: bool, score_func: str) -> tuple[Tensor, Tensor]:
    tokens = logits.shape[0]
    if tokens == 0:
        return (logits.new_empty((0, top_k), dtype=_F32), logits.new_empty((0, top_k), dtype=_I32))
    softmax = score_func == "softmax"
    # float32 logits: the gate returns its weights in x's dtype and the contract's are float32.
    # The wheel documents renorm=0 only, so softmax + norm_topk_prob normalises here.
    weights, ids, _ = backend.runtime.npu_moe_gating_top_k(
        logits.to(_F32).contiguous(), top_k, bias=None if bias is None else bias.to(_F32),
        k_group=topk_group, group_count=n_group, group_select_mode=1, renorm=0,
        norm_type=0 if softmax else 1, out_flag=False,
        routed_scaling_factor=1.0 if softmax and norm_topk_prob else float(routed_scaling_factor), eps=1e-20)
    if softmax and norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * routed_scaling_factor
    return weights.to(_F32), ids.to(_I32)


def moe_permute_supported(backend: "AscendBackend", x, ids, num_experts) -> Verdict:
    if num_experts + 1 > ROUTING_MAX_EXPERT_NUM:
        return (f"npu_moe_init_routing_v2 takes expert_num <= {ROUTING_MAX_EXPERT_NUM}; the adapter needs "
                f"num_experts + 1 = {num_experts + 1}")
    if x.shape[1] == 0:
        return "npu_moe_init_routing_v2 needs a hidden size H >= 1"
    return True


def moe_permute(backend: "AscendBackend", x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    tokens, k = ids.shape
    if tokens == 0:
        return no_permuted_rows(x, ids, num_experts)
    # Ids outside [0, E) must be dropped, but the op requires ids < expert_num: send them
    # to a spare expert E outside active_expert_range [0, E), which the op drops.
    routed = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(_I32).contiguous()
    expanded_x, expanded_row_idx, counts, _ = backend.runtime.npu_moe_init_routing_v2(
        x.contiguous(), routed, active_num=tokens * k, expert_num=num_experts + 1,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
        active_expert_range=[0, num_experts], row_idx_type=1)
    # row_idx_type 1: row r <- flat index expanded_row_idx[r] (our src); a stable sort by
    # expert, i.e. expert-ascending then flat-index-ascending, valid rows first
    rows = int(counts.sum())
    return expanded_x[:rows], counts.to(_I32), expanded_row_idx[:rows].to(_I32)


def moe_unpermute(backend: "AscendBackend", y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    tokens, k = weights.shape
    hidden = y.shape[1]
    if tokens == 0 or hidden == 0:
        return y.new_zeros((tokens, hidden))
    # Rows at their flat (t, j) slot, token-major (drop_pad_mode 2); slots without a row
    # stay zero, repeated src entries add up as the contract says. Float32 rows and
    # scales: the op wants scales in the rows' dtype and the contract's weights are fp32.
    slotted = y.new_zeros((tokens * k, hidden), dtype=_F32)
    slotted.index_put_((src.long(),), y.to(_F32), accumulate=True)
    identity = torch.arange(tokens * k, dtype=_I32, device=y.device)
    out = backend.runtime.npu_moe_finalize_routing(
        slotted, None, None, None, weights.to(_F32).contiguous(), identity, None, drop_pad_mode=2, k=k)
    return out.to(y.dtype)


def grouped_gemm_supported(backend: "AscendBackend", x, w, tokens_per_expert) -> Verdict:
    experts, n, k = w.shape
    if experts > GMM_MAX_GROUPS:
        return f"npu_grouped_matmul takes at most {GMM_MAX_GROUPS} groups with one weight tensor, got {experts}"
    if max(n, k) >= GMM_MAX_LAST_DIM:
        return f"npu_grouped_matmul needs K and N < {GMM_MAX_LAST_DIM}, got K={k}, N={n}"
    return True


def grouped_gemm(backend: "AscendBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    rows, n = x.shape[0], w.shape[1]
    if rows == 0 or n == 0:
        return x.new_zeros((rows, n))
    if x.shape[1] == 0:
        return x.new_zeros((rows, n))
    # the op's weight is [E, K, N]; a transposed view of our [E, N, K] is accepted as is
    return backend.runtime.npu_grouped_matmul(
        [x.contiguous()], [w.transpose(1, 2)], group_list=tokens_per_expert.to(_I64), group_list_type=1,
        group_type=0, split_item=2)[0]


# -- KV cache ----------------------------------------------------------------------------------
def _written_slots(slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """(rows to write, their slots as [n, 1] indices): npu_scatter_nd_update_ does not skip
    out-of-range indices, so the -1 padding rows are removed before the call."""
    written = slot_mapping >= 0
    return written, slot_mapping[written].view(-1, 1)


def _as_bytes(t: Tensor) -> Tensor:
    """FP8 tensors as int8 of the same bytes: the scatter has no FP8 dtype and copies bits."""
    return t.view(torch.int8) if t.dtype == _FP8 else t


def kv_cache_write(backend: "AscendBackend", cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    written, slots = _written_slots(slot_mapping)
    if slots.numel() == 0 or cache.shape[-1] == 0:
        return None
    rows = values[written].contiguous()
    backend.runtime.npu_scatter_nd_update_(_as_bytes(cache.view(-1, cache.shape[-1])), slots,
                                           _as_bytes(rows))
    return None


def indexer_k_cache_write_supported(backend: "AscendBackend", k, k_cache, k_scale, slot_mapping, scale_fmt) -> Verdict:
    return first_reason(
        backend.fp8_declined,
        lambda: None if k.shape[1] == BLOCK_QUANT_COLS else
        f"npu_dynamic_block_quant quantises blocks of {BLOCK_QUANT_COLS} columns only, the key rows have "
        f"D = {k.shape[1]}",
        lambda: None if scale_fmt is None else
        "npu_dynamic_block_quant has no power-of-two (ue8m0) scale option")


def indexer_k_cache_write(backend: "AscendBackend", k: Tensor, k_cache: Tensor, k_scale: Tensor, slot_mapping: Tensor,
                          scale_fmt: str | None) -> None:
    written, slots = _written_slots(slot_mapping)
    if slots.numel() == 0:
        return None
    # one key row is one 1 x 128 block: its scale is the row's scale
    q, scale = backend.runtime.npu_dynamic_block_quant(
        k[written].contiguous(), min_scale=FP8_MIN_AMAX / FP8_MAX, dst_type=_FP8, row_block_size=1,
        col_block_size=BLOCK_QUANT_COLS)
    backend.runtime.npu_scatter_nd_update_(_as_bytes(k_cache.view(-1, k_cache.shape[-1])), slots, _as_bytes(q))
    backend.runtime.npu_scatter_nd_update_(k_scale.view(-1, 1), slots, scale.view(-1, 1))
    return None


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS, supports=rms_norm_supported),
    Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS),
    Adapter("apply_rope", apply_rope, dtypes=FLOATS, supports=apply_rope_supported),
    Adapter("hadamard_transform", hadamard_transform, dtypes=FLOATS, supports=hadamard_transform_supported),
    Adapter("fp8_block_quant", fp8_block_quant, dtypes=HALVES, supports=fp8_block_quant_supported),
    Adapter("indexer_topk", indexer_topk, dtypes=HALVES, supports=indexer_topk_supported),
    Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=HALVES, supports=indexer_topk_paged_supported),
    Adapter("sparse_mla_attention", sparse_mla_attention, dtypes=HALVES, supports=sparse_mla_attention_supported),
    Adapter("sparse_mla_decode_paged", sparse_mla_decode_paged, dtypes=HALVES,
            supports=sparse_mla_decode_paged_supported),
    Adapter("moe_route", moe_route, dtypes=FLOATS, supports=moe_route_supported),
    Adapter("moe_permute", moe_permute, dtypes=FLOATS, supports=moe_permute_supported),
    Adapter("moe_unpermute", moe_unpermute, dtypes=FLOATS),
    Adapter("grouped_gemm", grouped_gemm, dtypes=FLOATS, supports=grouped_gemm_supported),
    Adapter("kv_cache_write", kv_cache_write, dtypes=FLOATS + (_FP8,)),
    Adapter("indexer_k_cache_write", indexer_k_cache_write, dtypes=HALVES, supports=indexer_k_cache_write_supported),
)
