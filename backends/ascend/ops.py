"""Adapters from glm5_hal's canonical ops to torch_npu's fused ops.

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
AscendBackend instance binds to itself; it reaches the vendor through `backend.runtime` (the
real `torch_npu`, or an emulator in tests), so several instances coexist. Inputs arrive
validated by glm5_hal.ops; an adapter converts layouts and index conventions, calls the
vendor op and returns exactly the canonical outputs. Each adapter's predicate checks the vendor's
documented per-call constraints -- and the versioned behaviours of versions.py -- and returns
a reason when the call falls outside them, so dispatch moves on instead of the vendor op
failing on the device.

No adapter reads device data on the host (tests/no_sync.py proves it per adapter): index
tensors the vendor ops want are built on the device, data checks run only where
glm5_hal.vendor_backend.host_reads_allowed says so (CPU tensors, GLM5_HAL_CHECKS=full). The one
exception is moe_permute, whose output size (the number of kept rows) is device data by the
op's contract.

Constraints are cited from the torch-npu 2.13.0 wheel's `torch_npu/_op_plugin_docs.py` (DOCS)
unless a comment names another source; README.md has the table of what maps to what.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from glm5_hal.vendor_backend import Adapter, Verdict, first_reason, host_reads_allowed
from glm5_hal.vendor_ops.common import rope_angles, weight_cast_declined
from glm5_hal.vendor_ops.dsa import pad_heads
from glm5_hal.vendor_ops.kv import paged_view_declined
from glm5_hal.vendor_ops.moe import no_permuted_rows

from .versions import KernelRules

if TYPE_CHECKING:
    from . import AscendBackend

_F32, _F16, _BF16, _I32, _I64 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64
_FP8 = torch.float8_e4m3fn
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

# -- vendor constraints (DOCS unless noted; the CANN attention rules per release are in versions.py,
# whose READMEs -- ops-transformer attention/{lightning_indexer,sparse_flash_attention}/README.md,
# v8.5.0 to v9.1.0.pre -- are the "LI/SFA README" below) ---------------------------------------
INDEXER_DIM = 128                                    # LI README: "query中的D和key中的D值相等为128"
INDEXER_MAX_COUNT = 2048                             # DOCS, npu_lightning_indexer: sparse_count 1-2048 (+ larger)
PAGED_BLOCK_MULTIPLE, PAGED_BLOCK_MAX = 16, 1024     # LI and SFA READMEs: block_size a multiple of 16, <= 1024
SFA_NOPE, SFA_ROPE = 512, 64                         # SFA README: Q_D = KV_D = 512, rope Dr = 64
SFA_MAX_HEADS = 128                                  # SFA README: N1 at most 128 (heads are chunked by it)
GATING_MAX_EXPERTS = 2048                            # npu_moe_gating_top_k: x's last dim <= 2048
ROUTING_MAX_EXPERT_NUM = 10240                       # npu_moe_init_routing_v2: expert_num in (0, 10240]
GMM_MAX_GROUPS, GMM_MAX_LAST_DIM = 1024, 65536       # npu_grouped_matmul: group_list <= 1024, InnerLimit
ROTARY_MAX_HEADS, ROTARY_MAX_DIM = 1000, 896         # npu_rotary_mul: B*N < 1000, D < 896 (both modes)
HADAMARD_MIN_DIM, HADAMARD_MAX_DIM = 16, 8192        # csrc/glm5_hal_ascend.h (our own kernel)
QMM_MAX_DIM = 65535                                  # npu_quant_matmul: last dims of x1, x2 <= 65535
PER_TOKEN_OUT = (_BF16, _F16)                        # per-token quantised matmuls: output dtypes

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "npu_rms_norm": "gamma in x's dtype (fp32 x casts its weight exactly)",
    "npu_lightning_indexer": f"query heads, products, float32 weights and sparse_count > {INDEXER_MAX_COUNT} by CANN "
                             f"release (versions.INDEXER_RULES; fewer heads are zero-padded); D = {INDEXER_DIM}, one "
                             f"key head, bf16/fp16, PA_BSND block_size a multiple of {PAGED_BLOCK_MULTIPLE} up to "
                             f"{PAGED_BLOCK_MAX}; indexer_topk on a device only under GLM5_HAL_CHECKS=full "
                             "(its batches come from host-read key ranges)",
    "npu_sparse_flash_attention": f"MLA-absorb only: D = {SFA_NOPE} + {SFA_ROPE}, one KV head; heads and products "
                                  "by CANN release (versions.ATTENTION_RULES; other head counts are chunked and "
                                  "zero-padded), bf16/fp16",
    "npu_moe_gating_top_k": f"E <= {GATING_MAX_EXPERTS}, more than 2 experts per group, sigmoid scores "
                            "always renormalised",
    "npu_moe_init_routing_v2": f"expert_num <= {ROUTING_MAX_EXPERT_NUM} (the adapter uses num_experts + 1)",
    "npu_moe_finalize_routing": "drop_pad_mode 0 only (K-major row indices)",
    "npu_grouped_matmul": f"<= {GMM_MAX_GROUPS} experts, last dims < {GMM_MAX_LAST_DIM}; a one-entry group_list only "
                          "as a cumulative sum (group_list_type 0)",
    "npu_rotary_mul": f"B*N < {ROTARY_MAX_HEADS} heads, D < {ROTARY_MAX_DIM} in both modes",
    "npu_scatter_nd_update_": "no skipping of out-of-range slots (padding rows repeat a real row's write); FP8 rows "
                              "are written as their int8 bytes",
    "hadamard (Ascend C)": f"D a power of two in [{HADAMARD_MIN_DIM}, {HADAMARD_MAX_DIM}]",
    "npu_dynamic_quant": "int8 per token, bf16/fp16 input, Atlas A2/A3; rows of zeros set to codes 0 on the device",
    "npu_quant_matmul": f"int8 x int8 with per-token and per-channel scales, K and N <= {QMM_MAX_DIM}, bfloat16/"
                        "float16 output, Atlas A2/A3; no bias (where the op adds it is not documented)",
    "npu_grouped_matmul (int8)": "per-token mode: scale [E, N] (bfloat16 for a bfloat16 output, float32 for "
                                 "float16), per_token_scale [M], bfloat16/float16 output, "
                                 "Atlas A2/A3",
    "fp8_block_gemm / fp8_grouped_gemm": "not adapted: no torch_npu op documents a 128 x 128 block-scaled FP8 GEMM "
                                         "(the 950's FP8 path is MX: npu_dynamic_mx_quant, e8m0 scales per 32)",
    "fp8_block_quant / indexer_k_cache_write": "not adapted: npu_dynamic_block_quant documents int8 output only "
                                               "(dst_type 1), on Atlas A2/A3",
}


#: Where the vendor's golden references (Ascend ops-transformer v9.1.0.pre, 121f37de) compute
#: more coarsely than the op contract's tolerances (docs/conformance.md): the adapters concerned
#: decline such calls unless the backend accepts the vendor's precision
#: (GLM5_HAL_ASCEND_VENDOR_PRECISION=1). The sparse attention golden's P rounded to the query's
#: dtype before P @ V is within the contract (its attention slack) and is not listed.
PRECISION = {
    "npu_lightning_indexer": "attention/lightning_indexer/tests/pytest/lightning_indexer_golden.py rounds the "
                             "float32 scores to bfloat16 before its stable sort (keys within 2^-8 relative tie; "
                             "the contract ranks in float32)",
}


def _precision_declined(backend: "AscendBackend", why: str) -> str | None:
    if backend.vendor_precision:
        return None
    return f"{why} (set GLM5_HAL_ASCEND_VENDOR_PRECISION=1 to accept the vendor's precision)"


def _versioned(backend: "AscendBackend", *names: str) -> str | None:
    """The reason to decline a call depending on versioned behaviours `names` (versions.py)
    when one is unverified for the installed versions."""
    return next((why for why in map(backend.unverified, names) if why), None)


# -- shared conversions ------------------------------------------------------------------------
def left_pack(indices: Tensor, valid: Tensor) -> Tensor:
    """Valid entries of each row first, in their original order, then -1: the vendor's
    "valid first, invalid after" convention (the attention kernel stops at the first -1)."""
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    packed = indices.gather(-1, order)
    rank = torch.arange(indices.shape[-1], device=indices.device)
    return torch.where(rank < valid.sum(-1, keepdim=True), packed, -1).to(_I32)


def cumulative(count: int, step: int, device: torch.device) -> Tensor:
    """int32 [step, 2 step, ..., count * step]: TND prefix-sum lengths of `count` equal
    batches, built on the device (a host-built tensor would be a blocking copy)."""
    return torch.arange(1, count + 1, dtype=_I32, device=device) * step


def head_chunks(heads: int, accepted: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first, end, padded) head ranges: chunks of at most 128 heads, each padded up to a
    head count the kernel accepts (heads are independent in attention)."""
    chunks = []
    for first in range(0, heads, SFA_MAX_HEADS):
        end = min(first + SFA_MAX_HEADS, heads)
        chunks.append((first, end, next(n for n in accepted if n >= end - first)))
    return chunks


# -- common ------------------------------------------------------------------------------------
def rms_norm_supported(backend: "AscendBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return first_reason(lambda: _versioned(backend, "npu_op_schemas"),
                        lambda: weight_cast_declined(x, weight, "npu_rms_norm takes gamma"))


def rms_norm(backend: "AscendBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    # npu_rms_norm wants 2-8 dims and normalises over gamma's dims: [rows, D] covers all.
    rows = x.reshape(-1, x.shape[-1])
    y, _rstd = backend.runtime.npu_rms_norm(rows, weight.to(x.dtype), epsilon=float(eps))
    return y.view(x.shape)


def silu_and_mul_supported(backend: "AscendBackend", x: Tensor) -> Verdict:
    return first_reason(lambda: _versioned(backend, "npu_op_schemas"))


def silu_and_mul(backend: "AscendBackend", x: Tensor) -> Tensor:
    out_shape = (*x.shape[:-1], x.shape[-1] // 2)
    if x.numel() == 0:
        return x.new_empty(out_shape)
    # npu_swiglu: swish(A) * B with A the first half, as the contract's [gate, up]
    return backend.runtime.npu_swiglu(x.reshape(-1, x.shape[-1]), dim=-1).view(out_shape)


def apply_rope_supported(backend: "AscendBackend", x: Tensor, positions: Tensor, theta: float,
                         interleaved: bool) -> Verdict:
    heads, rot = x.shape[1], x.shape[2]
    return first_reason(
        lambda: _versioned(backend, "npu_op_schemas"),
        lambda: None if heads < ROTARY_MAX_HEADS else
        f"npu_rotary_mul needs B*N < {ROTARY_MAX_HEADS}, got {heads} heads",
        # DOCS, npu_rotary_mul: half mode "D < 896，且为2的倍数", interleave mode "D < 896, 且D为2的倍数"
        lambda: None if rot < ROTARY_MAX_DIM else
        f"npu_rotary_mul needs D < {ROTARY_MAX_DIM} in {'interleave' if interleaved else 'half'} mode, got {rot}")


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


# -- DSA ---------------------------------------------------------------------------------------
def _rules(backend: "AscendBackend", name: str) -> KernelRules:
    return backend.behaviour(name)


def _kernel_declined(backend: "AscendBackend", op: str, rules: str) -> str | None:
    """The reason the chip and versions have no such kernel (versions.py)."""
    why = _versioned(backend, "npu_op_schemas", "npu_dsa_ops", rules)
    if why:
        return why
    if not backend.behaviour("npu_dsa_ops"):
        return f"torch_npu {backend.versions().get('torch_npu')} has no {op} (versions.DSA_OPS)"
    products = _rules(backend, rules).products()
    if backend.generation.key not in products:
        return (f"{op} does not run on {backend.generation.label} with CANN {backend.versions().get('CANN')} "
                f"(its README lists {', '.join(products)})")
    return None


def _indexer_declined(backend: "AscendBackend", q: Tensor, k: object, topk: int, max_keys: int) -> str | None:
    why = _kernel_declined(backend, "npu_lightning_indexer", "indexer_rules")
    if why:
        return why
    if isinstance(k, (tuple, list)):
        return ("npu_lightning_indexer takes bf16/fp16 keys; FP8 key pairs would need "
                "npu_quant_lightning_indexer, which also quantises q (not adapted)")
    rules, product = _rules(backend, "indexer_rules"), backend.generation.key
    heads, dim = q.shape[-2], q.shape[-1]
    if rules.padded_heads(product, heads) is None:
        return (f"npu_lightning_indexer runs at most {max(rules.head_counts(product))} query heads (N1) here; "
                f"{heads} heads do not fit")
    if dim != INDEXER_DIM:
        return f"npu_lightning_indexer needs head dim D = {INDEXER_DIM}, got {dim}"
    if topk < max_keys:
        # PRECISION: keys within a bfloat16 step of the k-th score swap, far beyond the
        # contract's float32 top-k tolerance; a topk that takes every key is exact
        why = _precision_declined(
            backend, f"npu_lightning_indexer ranks bfloat16-rounded scores (the vendor golden), coarser than the "
            f"contract's float32 top-k; it runs only when topk covers every key (topk {topk} < {max_keys} keys)")
        if why:
            return why
    if not (1 <= topk <= INDEXER_MAX_COUNT or topk in rules.large_counts):
        # a larger sparse_count truncated to topk would rely on the output being sorted by
        # score: the golden sorts, but the vendor's own test compares sorted index sets
        # (lightning_indexer_golden.py, li_output_single), so the order is not verified
        return (f"npu_lightning_indexer's sparse_count takes 1-{INDEXER_MAX_COUNT}"
                f"{' or ' + str(rules.large_counts) if rules.large_counts else ''} here, topk is {topk}")
    return None


def _weights_declined(backend: "AscendBackend", q: Tensor, weights: Tensor) -> str | None:
    """Where the indexer takes the head weights only in q's dtype (CANN 8.5, the 950),
    rounding our float32 weights would move scores by up to 2^-9 relative and reorder
    near-tied keys beyond the contract's top-k tolerance (the conformance suite caught exactly
    that), so only weights that survive the cast unchanged go to the vendor op. That is a data
    check: on a device it runs only under GLM5_HAL_CHECKS=full."""
    if backend.generation.key in _rules(backend, "indexer_rules").fp32_weights:
        return None
    dtype = str(q.dtype).removeprefix("torch.")
    if not host_reads_allowed(weights):
        return (f"npu_lightning_indexer takes weights in q's dtype ({dtype}) here; whether these float32 weights "
                "survive that cast is a data check, run on a device only under GLM5_HAL_CHECKS=full")
    if not torch.equal(weights.to(q.dtype).to(weights.dtype), weights):
        return (f"npu_lightning_indexer takes weights in q's dtype ({dtype}) here; these float32 weights are not "
                "exactly representable in it (rounding would reorder the top-k)")
    return None


def _indexer_inputs(backend: "AscendBackend", q: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """q and weights with the heads zero-padded to a count the indexer accepts (a zero-weight
    head adds nothing to sum_h w_h relu(q_h . k)); weights float32 where the indexer takes
    them, else in q's dtype (exact: see _weights_declined)."""
    rules, product = _rules(backend, "indexer_rules"), backend.generation.key
    heads = rules.padded_heads(product, q.shape[-2])
    dtype = _F32 if product in rules.fp32_weights else q.dtype
    return pad_heads(q, heads, -2), pad_heads(weights.to(dtype), heads, -1)


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


def indexer_topk_supported(backend: "AscendBackend", q, k, weights, k_start, k_end, topk) -> Verdict:
    keys = (k[0] if isinstance(k, (tuple, list)) else k).shape[0]
    return first_reason(
        lambda: _indexer_declined(backend, q, k, topk, keys),
        # the vendor op takes per-batch lengths: the batches come from the per-token key
        # ranges, read on the host
        lambda: None if host_reads_allowed(k_start) else
        ("npu_lightning_indexer's TND batches come from the per-token key ranges read on the host; on a device "
         "that runs only under GLM5_HAL_CHECKS=full (indexer_topk_paged needs no such read)"),
        lambda: _weights_declined(backend, q, weights))


def indexer_topk(backend: "AscendBackend", q: Tensor, k: Tensor, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    tokens, device = q.shape[0], q.device
    out = torch.full((tokens, topk), -1, dtype=_I32, device=device)
    runs = causal_runs(k_start.tolist(), k_end.tolist())  # allowed by supports(): CPU or full checks
    if not runs:
        return out
    q_in, w_in = _indexer_inputs(backend, q, weights)
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
        q_lengths = torch.tensor([b - a for a, b, *_ in group], dtype=_I64).cumsum(0).to(_I32).to(device)
        k_lengths = torch.tensor([kl for *_, kl, _ in group], dtype=_I64).cumsum(0).to(_I32).to(device)
        found, _ = backend.runtime.npu_lightning_indexer(
            q_in.index_select(0, token_idx), key, w_in.index_select(0, token_idx),
            actual_seq_lengths_query=q_lengths, actual_seq_lengths_key=k_lengths,
            layout_query="TND", layout_key="TND", sparse_count=topk, sparse_mode=mode)
        found = found[:, 0, :topk].long()
        offset = torch.cat([torch.full((b - a,), ks, dtype=_I64) for a, b, ks, *_ in group]).to(device)
        out[token_idx] = torch.where(found >= 0, found + offset.unsqueeze(-1), -1).to(_I32)
    return out


def indexer_topk_paged_supported(backend: "AscendBackend", q, k_cache, weights, block_table, context_lens,
                                 topk) -> Verdict:
    cache = k_cache[0] if isinstance(k_cache, (tuple, list)) else k_cache
    block_size = cache.shape[1]
    visible = min(block_table.shape[1], cache.shape[0]) * block_size  # no sequence sees more keys
    return first_reason(
        lambda: _indexer_declined(backend, q, k_cache, topk, visible),
        lambda: None if block_size % PAGED_BLOCK_MULTIPLE == 0 and block_size <= PAGED_BLOCK_MAX else
        (f"npu_lightning_indexer's PA_BSND cache needs block_size a multiple of {PAGED_BLOCK_MULTIPLE} up to "
         f"{PAGED_BLOCK_MAX}, got {block_size}"),
        lambda: _weights_declined(backend, q, weights))


def indexer_topk_paged(backend: "AscendBackend", q: Tensor, k_cache: Tensor, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    batch, queries = q.shape[0], q.shape[1]
    num_blocks, max_blocks = k_cache.shape[0], block_table.shape[1]
    if batch * queries == 0 or num_blocks == 0 or max_blocks == 0:  # nothing is visible
        return torch.full((batch, queries, topk), -1, dtype=_I32, device=q.device)
    q_in, w_in = _indexer_inputs(backend, q, weights)
    # table entries past a sequence's blocks are ignored by the contract and never read
    # by the kernel (it does not validate ids); clamped so no garbage id reaches it
    table = block_table.clamp(0, num_blocks - 1).to(_I32).contiguous()
    found, _ = backend.runtime.npu_lightning_indexer(
        q_in, k_cache.unsqueeze(2).contiguous(), w_in,
        actual_seq_lengths_query=torch.full((batch,), queries, dtype=_I32, device=q.device),
        actual_seq_lengths_key=context_lens.to(_I32).contiguous(), block_table=table,
        layout_query="BSND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=3)
    return found[:, :, 0, :topk].contiguous()


def _attention_declined(backend: "AscendBackend", q: Tensor, d_v: int) -> str | None:
    why = _kernel_declined(backend, "npu_sparse_flash_attention", "sparse_attention_rules")
    if why:
        return why
    dqk = q.shape[-1]
    if dqk != SFA_NOPE + SFA_ROPE:
        return (f"npu_sparse_flash_attention runs MLA-absorb mode only: Dqk = {SFA_NOPE} + {SFA_ROPE}, "
                f"got {dqk}")
    if d_v > SFA_NOPE:
        return f"npu_sparse_flash_attention returns the {SFA_NOPE} latent dims, d_v {d_v} is larger"
    # The golden rounds P to the query's dtype before P @ V (sparse_flash_attention_golden.py);
    # the contract's attention tolerance allows exactly that (docs/conformance.md), so no decline.
    return None


def _attention(backend: "AscendBackend", q: Tensor, key_rows: Tensor, local: Tensor, cu_kv: Tensor, cu_q: Tensor,
               sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """npu_sparse_flash_attention in MLA-absorb mode over TND query and key batches:
    q [T, H, 576], key_rows [S, 576], local [T, K] left-packed positions within each
    token's batch, cu_kv / cu_q the batches' prefix-sum lengths (int32, on the device).
    Returns (out [T, H, d_v], lse [T, H] float32)."""
    tokens, heads = q.shape[0], q.shape[1]
    key = key_rows[:, :SFA_NOPE].contiguous().view(-1, 1, SFA_NOPE)
    key_rope = key_rows[:, SFA_NOPE:].contiguous().view(-1, 1, SFA_ROPE)
    indices = local.view(tokens, 1, -1).contiguous()
    accepted = _rules(backend, "sparse_attention_rules").head_counts(backend.generation.key)
    outs, lses = [], []
    for first, end, padded in head_chunks(heads, accepted):
        chunk = q[:, first:end]
        out, softmax_max, softmax_sum = backend.runtime.npu_sparse_flash_attention(
            pad_heads(chunk[..., :SFA_NOPE], padded, 1), key, key, indices, float(sm_scale),
            actual_seq_lengths_query=cu_q, actual_seq_lengths_kv=cu_kv,
            query_rope=pad_heads(chunk[..., SFA_NOPE:], padded, 1), key_rope=key_rope,
            sparse_block_size=1, layout_query="TND", layout_kv="TND", sparse_mode=0, attention_mode=2,
            return_softmax_lse=True)
        outs.append(out[:, : end - first, :d_v])
        # lse = max + log(sum of exp(z - max)); a row with no position has sum 0 (the golden
        # leaves max and sum at 0) -> -inf
        lses.append(softmax_max[0, :, : end - first] + torch.log(softmax_sum[0, :, : end - first]))
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1).to(_F32)
    # the contract's empty row (no valid index) is out 0, whatever the kernel leaves there
    return torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, out).to(q.dtype), lse


def _empty_attention(q: Tensor, d_v: int) -> tuple[Tensor, Tensor]:
    lead = q.shape[:-1]
    return q.new_zeros((*lead, d_v)), torch.full(lead, float("-inf"), dtype=_F32, device=q.device)


def sparse_mla_attention_supported(backend: "AscendBackend", q, kv, indices, sm_scale, d_v) -> Verdict:
    return _attention_declined(backend, q, d_v) or True


def sparse_mla_attention(backend: "AscendBackend", q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                         d_v: int) -> tuple[Tensor, Tensor]:
    tokens, num_keys = q.shape[0], kv.shape[0]
    topk = indices.shape[-1]
    if tokens == 0 or num_keys == 0:
        return _empty_attention(q, d_v)
    # One TND batch holding every key, sparse_mode 0 so only the batch length bounds the
    # indices. The kernel walks at most min(topk, batch length) entries of a row
    # (sparse_flash_attention_golden.py, gatherKV): with topk > S the batch is padded with
    # zero rows to topk, which no index reaches, so repeated indices all count.
    local = left_pack(indices, (indices >= 0) & (indices < num_keys))
    rows = kv if topk <= num_keys else torch.cat((kv, kv.new_zeros((topk - num_keys, kv.shape[1]))))
    device = q.device
    return _attention(backend, q, rows, local, cumulative(1, rows.shape[0], device), cumulative(1, tokens, device),
                      sm_scale, d_v)


def sparse_mla_decode_paged_supported(backend: "AscendBackend", q, kv_cache, block_table, context_lens, indices,
                                      sm_scale, d_v) -> Verdict:
    return _attention_declined(backend, q, d_v) or True


def sparse_mla_decode_paged(backend: "AscendBackend", q: Tensor, kv_cache: Tensor, block_table: Tensor,
                            context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    batch, queries, heads, dqk = q.shape
    topk = indices.shape[-1]
    block_size = kv_cache.shape[1]
    if batch * queries == 0 or kv_cache.shape[0] == 0:
        return _empty_attention(q, d_v)
    # Gather each token's selected rows into its own TND batch: with the vendor's PA_BSND
    # path the kernel cannot return the lse (training-only, not with PA), and it would
    # need the canonical [.., 576] cache split into two contiguous caches (a full copy).
    # A token with nothing valid gets an all -1 row: out 0 and lse -inf below.
    valid = (indices >= 0) & (indices < context_lens.view(-1, 1, 1))
    pos = torch.where(valid, indices.long(), 0)
    blocks = block_table.long().gather(1, (pos // block_size).view(batch, -1)).view(pos.shape)
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    rows = kv_cache.reshape(-1, dqk)[slots.view(-1)]                        # [B*N*K, 576]
    tokens = batch * queries
    ranks = torch.arange(topk, device=q.device).expand(tokens, topk)
    local = left_pack(ranks, valid.view(tokens, topk))
    out, lse = _attention(backend, q.reshape(tokens, heads, dqk), rows, local, cumulative(tokens, topk, q.device),
                         cumulative(tokens, 1, q.device), sm_scale, d_v)
    return out.view(batch, queries, heads, d_v), lse.view(batch, queries, heads)


# -- MoE ---------------------------------------------------------------------------------------
def moe_route_supported(backend: "AscendBackend", logits, bias, top_k, n_group, topk_group, routed_scaling_factor,
                        norm_topk_prob, score_func) -> Verdict:
    experts = logits.shape[1]
    per_group = experts // n_group
    aligned = -(-per_group // 32) * 32 * n_group
    return first_reason(
        lambda: _versioned(backend, "npu_op_schemas"),
        lambda: None if not (score_func == "sigmoid" and not norm_topk_prob) else
        "npu_moe_gating_top_k always renormalises sigmoid scores (norm_type 1); "
        "norm_topk_prob=False is not expressible",
        lambda: None if experts <= GATING_MAX_EXPERTS else
        f"npu_moe_gating_top_k takes at most {GATING_MAX_EXPERTS} experts, got {experts}",
        lambda: None if per_group > 2 else f"npu_moe_gating_top_k needs more than 2 experts per group, got {per_group}",
        lambda: None if aligned <= GATING_MAX_EXPERTS else
        f"npu_moe_gating_top_k needs Align32(E / n_group) * n_group <= {GATING_MAX_EXPERTS}, got {aligned}")


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
    return first_reason(
        lambda: _versioned(backend, "npu_op_schemas"),
        lambda: None if num_experts + 1 <= ROUTING_MAX_EXPERT_NUM else
        (f"npu_moe_init_routing_v2 takes expert_num <= {ROUTING_MAX_EXPERT_NUM}; the adapter needs "
         f"num_experts + 1 = {num_experts + 1}"),
        lambda: None if x.shape[1] else "npu_moe_init_routing_v2 needs a hidden size H >= 1")


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
    # expert, i.e. expert-ascending then flat-index-ascending, valid rows first. The number of
    # kept rows is the op's output size: device data by the contract, read here (the one read).
    rows = int(counts.sum())
    return expanded_x[:rows], counts.to(_I32), expanded_row_idx[:rows].to(_I32)


def moe_unpermute_supported(backend: "AscendBackend", y, src, weights) -> Verdict:
    return first_reason(lambda: _versioned(backend, "npu_op_schemas"))


def moe_unpermute(backend: "AscendBackend", y: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    tokens, k = weights.shape
    hidden = y.shape[1]
    if tokens == 0 or hidden == 0:
        return y.new_zeros((tokens, hidden))
    # Rows at their flat (t, j) slot; slots without a row stay zero, repeated src entries add
    # up as the contract says. Float32 rows and scales: the op wants scales in the rows' dtype
    # ("数据类型要求与expanded_permuted_rows一致") and the contract's weights are fp32.
    slotted = y.new_zeros((tokens * k, hidden), dtype=_F32)
    slotted.index_put_((src.long(),), y.to(_F32), accumulate=True)
    # DOCS: drop_pad_mode "取值范围为0" and out(i) sums scales[i, k] * rows[idx[i + k * T]] (K-major):
    # slot t*k + j sits at position j*T + t. K comes from scales' shape (no `k=`, which only the
    # 2026-10 wheels declare).
    k_major = torch.arange(tokens * k, dtype=_I32, device=y.device).view(tokens, k).t().reshape(-1)
    out = backend.runtime.npu_moe_finalize_routing(
        slotted, None, None, None, weights.to(_F32).contiguous(), k_major, None, drop_pad_mode=0)
    return out.to(y.dtype)


def grouped_gemm_supported(backend: "AscendBackend", x, w, tokens_per_expert) -> Verdict:
    experts, n, k = w.shape
    return first_reason(
        lambda: _versioned(backend, "npu_op_schemas"),
        lambda: None if experts <= GMM_MAX_GROUPS else
        f"npu_grouped_matmul takes at most {GMM_MAX_GROUPS} groups with one weight tensor, got {experts}",
        lambda: None if max(n, k) < GMM_MAX_LAST_DIM else
        f"npu_grouped_matmul needs K and N < {GMM_MAX_LAST_DIM}, got K={k}, N={n}")


def group_list(tokens_per_expert: Tensor) -> tuple[Tensor, int]:
    """(group_list int64, group_list_type) for npu_grouped_matmul: the per-expert counts
    (type 1), except for a single expert, where DOCS forbid a one-entry group_list of type 1
    ("当group_list_type为1时, group_list必须为非负数列, 且长度不能为1") and the cumulative sum
    (type 0, no such rule) says the same."""
    if tokens_per_expert.shape[0] == 1:
        return tokens_per_expert.to(_I64).cumsum(0), 0
    return tokens_per_expert.to(_I64), 1


def grouped_gemm(backend: "AscendBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    rows, n = x.shape[0], w.shape[1]
    if rows == 0 or n == 0:
        return x.new_zeros((rows, n))
    if x.shape[1] == 0:
        return x.new_zeros((rows, n))
    groups, group_list_type = group_list(tokens_per_expert)
    # the op's weight is [E, K, N]; a transposed view of our [E, N, K] is accepted as is
    return backend.runtime.npu_grouped_matmul(
        [x.contiguous()], [w.transpose(1, 2)], group_list=groups, group_list_type=group_list_type,
        group_type=0, split_item=2)[0]


# -- W8A8 (the checkpoint-format GEMMs) -----------------------------------------------------------
# DOCS document npu_dynamic_quant, npu_quant_matmul and npu_grouped_matmul's per-token mode for
# Atlas A2/A3 (and inference cards); vllm-ascend @182b75ea serves W8A8 this way on A2/A3
# (vllm_ascend/quantization/methods/w8a8_dynamic.py, ops/fused_moe/moe_mlp.py). No op documents
# them on the 950, nor an FP8 block-scaled GEMM anywhere (see OP_LIMITS, README "Not mapped").
W8A8_PRODUCTS = ("A2", "A3")
#: npu_grouped_matmul's per-token mode pairs the weight scale's dtype with the output's:
#: DOCS' table for a Tensor group_list on A2 ("per-token量化": scale bfloat16 -> y bfloat16,
#: scale float32 -> y float16; torch-npu 2.13.0 torch_npu/_op_plugin_docs.py), and vllm-ascend
#: @182b75ea passes its W8A8 MoE scales in the output's dtype (device/device_op.py:279-290
#: npu_grouped_matmul_gmm2: output_dtype = the scale's dtype, ops/fused_moe/moe_mlp.py:378;
#: moe_mlp.py:281 and lora/quant_moe.py:205: `w1_scale[0].to(w2_scale[0].dtype)`).
GROUPED_PER_TOKEN_SCALE_DTYPE = {_BF16: _BF16, _F16: _F32}


def _w8a8_declined(backend: "AscendBackend", op: str, out_dtype: torch.dtype | None = None) -> str | None:
    why = _versioned(backend, "npu_op_schemas")
    if why:
        return why
    if backend.generation.key not in W8A8_PRODUCTS:
        return f"{op} is documented for Atlas A2/A3, not {backend.generation.label}"
    if out_dtype is not None and out_dtype not in PER_TOKEN_OUT:
        return (f"{op}'s per-token mode outputs bfloat16 or float16 (DOCS), not "
                f"{str(out_dtype).removeprefix('torch.')}")
    return None


def int8_quant_supported(backend: "AscendBackend", x: Tensor) -> Verdict:
    return first_reason(lambda: _w8a8_declined(backend, "npu_dynamic_quant"))


def int8_quant(backend: "AscendBackend", x: Tensor) -> tuple[Tensor, Tensor]:
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.int8, device=x.device), x.new_empty(x.shape[:-1], dtype=_F32)
    # DOCS: scale = rowMax(|x|) / 127, y = round(x / scale) (input of more than one dim); a row of
    # zeros divides 0 by 0, which the docs leave undefined: the contract's codes 0, set here
    q, scale = backend.runtime.npu_dynamic_quant(x.reshape(-1, x.shape[-1]), dst_type=torch.int8)
    q = torch.where(scale.unsqueeze(-1) == 0, 0, q).to(torch.int8)
    return q.view(x.shape), scale.view(x.shape[:-1])


def int8_gemm_supported(backend: "AscendBackend", x, x_scale, w, w_scale, out_dtype, bias) -> Verdict:
    k, n = x.shape[1], w.shape[0]
    return first_reason(
        lambda: _w8a8_declined(backend, "npu_quant_matmul", out_dtype),
        lambda: None if max(k, n) <= QMM_MAX_DIM else
        f"npu_quant_matmul takes K and N <= {QMM_MAX_DIM}, got K={k}, N={n}",
        lambda: None if bias is None else
        ("npu_quant_matmul takes a bias, but DOCS do not say whether it is added before or after the scales; "
         "a bias is not passed"))


def int8_gemm(backend: "AscendBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
              out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    rows, n = x.shape[0], w.shape[0]
    if rows == 0 or n == 0 or x.shape[1] == 0:
        return torch.zeros((rows, n), dtype=out_dtype, device=x.device)
    # x2 is [K, N]: the transposed view of our [N, K] weight is the documented form (DOCS' example
    # passes `x2.t()`); scale per channel [N], pertoken_scale per row [M], both float32
    return backend.runtime.npu_quant_matmul(x.contiguous(), w.t(), w_scale.contiguous(),
                                            pertoken_scale=x_scale.contiguous(), output_dtype=out_dtype)


def int8_grouped_gemm_supported(backend: "AscendBackend", x, x_scale, w, w_scale, tokens_per_expert,
                                out_dtype) -> Verdict:
    experts, n, k = w.shape
    return first_reason(
        lambda: _w8a8_declined(backend, "npu_grouped_matmul", out_dtype),
        lambda: None if experts <= GMM_MAX_GROUPS else
        f"npu_grouped_matmul takes at most {GMM_MAX_GROUPS} groups with one weight tensor, got {experts}",
        lambda: None if max(n, k) < GMM_MAX_LAST_DIM else
        f"npu_grouped_matmul needs K and N < {GMM_MAX_LAST_DIM}, got K={k}, N={n}")


def int8_grouped_gemm(backend: "AscendBackend", x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                      tokens_per_expert: Tensor, out_dtype: torch.dtype) -> Tensor:
    rows, n = x.shape[0], w.shape[1]
    if rows == 0 or n == 0 or x.shape[1] == 0:
        return torch.zeros((rows, n), dtype=out_dtype, device=x.device)
    groups, group_list_type = group_list(tokens_per_expert)
    # DOCS' per-token mode (formula 3): int8 x and weight [E, K] -> [E, K, N] as a transposed
    # view, per_token_scale float32 [M], and the weight scale in the dtype DOCS pair with the
    # output (GROUPED_PER_TOKEN_SCALE_DTYPE: bfloat16 for a bfloat16 y, float32 for float16).
    # Shape: DOCS say each scale tensor is 1-D on A2; vllm-ascend, the one public caller with a
    # single [E, K, N] weight, passes [E, N] -- followed here (README "npu_grouped_matmul's
    # per-token scale"). A bfloat16 scale is the float32 one rounded: 2^-9 relative, within the
    # bfloat16 output's tolerance.
    scale = w_scale.to(GROUPED_PER_TOKEN_SCALE_DTYPE[out_dtype]).contiguous()
    return backend.runtime.npu_grouped_matmul(
        [x.contiguous()], [w.transpose(1, 2)], scale=[scale], per_token_scale=[x_scale.contiguous()],
        group_list=groups, group_list_type=group_list_type, group_type=0, split_item=2, output_dtype=out_dtype)[0]


# -- KV cache ----------------------------------------------------------------------------------
def _as_bytes(t: Tensor) -> Tensor:
    """FP8 tensors as int8 of the same bytes: the scatter has no FP8 dtype and copies bits."""
    return t.view(torch.int8) if t.dtype == _FP8 else t


def kv_cache_write_supported(backend: "AscendBackend", cache, values, slot_mapping) -> Verdict:
    return first_reason(lambda: _versioned(backend, "npu_op_schemas"),
                        lambda: paged_view_declined("npu_scatter_nd_update_", cache))


def kv_cache_write(backend: "AscendBackend", cache: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    tokens, dim = values.shape
    if tokens == 0 or dim == 0:
        return None
    flat = _as_bytes(cache.view(-1, dim))
    # npu_scatter_nd_update_ does not skip out-of-range indices (DOCS), and dropping the -1
    # padding rows would size a tensor by device data. Each padding row repeats the write of
    # the first real row instead (an identical write: harmless whichever lands last); with no
    # real row at all it writes slot 0's own content back (read before the scatter, in stream
    # order).
    written = slot_mapping >= 0
    first = written.int().argmax().view(1)                         # the first real row (0 if none)
    any_real = written.any()
    fallback_slot = torch.where(any_real, slot_mapping.index_select(0, first), 0).to(slot_mapping.dtype)
    rows = _as_bytes(values)
    fallback_row = torch.where(any_real, rows.index_select(0, first), flat[:1])
    slots = torch.where(written, slot_mapping, fallback_slot).view(-1, 1)
    updates = torch.where(written.unsqueeze(-1), rows, fallback_row).contiguous()
    backend.runtime.npu_scatter_nd_update_(flat, slots, updates)
    return None


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=FLOATS, supports_metadata=rms_norm_supported),
    Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS, supports_metadata=silu_and_mul_supported),
    Adapter("apply_rope", apply_rope, dtypes=FLOATS, supports_metadata=apply_rope_supported),
    Adapter("hadamard_transform", hadamard_transform, dtypes=FLOATS, supports_metadata=hadamard_transform_supported),
    # per call: reads the key ranges on the host and the head weights' values
    Adapter("indexer_topk", indexer_topk, dtypes=HALVES, supports=indexer_topk_supported),
    # per call: whether the float32 head weights survive q's dtype is a data check
    Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=HALVES, supports=indexer_topk_paged_supported),
    Adapter("sparse_mla_attention", sparse_mla_attention, dtypes=HALVES,
            supports_metadata=sparse_mla_attention_supported),
    Adapter("sparse_mla_decode_paged", sparse_mla_decode_paged, dtypes=HALVES,
            supports_metadata=sparse_mla_decode_paged_supported),
    Adapter("moe_route", moe_route, dtypes=FLOATS, supports_metadata=moe_route_supported),
    Adapter("moe_permute", moe_permute, dtypes=FLOATS, supports_metadata=moe_permute_supported),
    Adapter("moe_unpermute", moe_unpermute, dtypes=FLOATS, supports_metadata=moe_unpermute_supported),
    Adapter("grouped_gemm", grouped_gemm, dtypes=FLOATS, supports_metadata=grouped_gemm_supported),
    # per call: reads the cache's contiguity (the call key holds only whether it is paged)
    Adapter("kv_cache_write", kv_cache_write, dtypes=FLOATS + (_FP8,), supports=kv_cache_write_supported),
    Adapter("int8_quant", int8_quant, dtypes=HALVES, supports_metadata=int8_quant_supported),
    Adapter("int8_gemm", int8_gemm, dtypes=(torch.int8,), supports_metadata=int8_gemm_supported),
    Adapter("int8_grouped_gemm", int8_grouped_gemm, dtypes=(torch.int8,),
            supports_metadata=int8_grouped_gemm_supported),
)
