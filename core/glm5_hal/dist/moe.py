"""Expert-parallel MoE dispatch and combine over all_to_all_single.

Experts are split contiguously over the ranks of the group: with E experts and W ranks,
rank r owns global experts [r*E/W, (r+1)*E/W) and calls them local experts 0..E/W-1.

moe_dispatch, on every rank:
1. picks the valid routing entries (t, j) (0 <= ids[t, j] < E; -1 and out-of-range ids are
   dropped, exactly as moe_permute drops them) and orders them like moe_permute: by global
   expert ascending, then by flat index t*k + j ascending. Since experts are contiguous per
   rank, this also groups them by destination rank;
2. exchanges the per-(destination, local expert) counts with one all_to_all_single;
3. sends every entry's row x[t] together with its weight (one all_to_all_single of packed
   bytes);
4. reorders the received rows into the order below.

Order of the received rows (recv_x, recv_local_ids, recv_weights): by local expert
ascending, then by source rank ascending, then by the source's flat index t*k + j
ascending. With one rank this is exactly moe_permute's order. tokens_per_local_expert[e]
counts the rows of local expert e, so the rows of e are contiguous, as grouped_gemm wants.

moe_combine sends the expert outputs back (one all_to_all_single) and computes, on the
rank that owns token t, out[t] = sum over its valid entries j of weights[t, j] * y_row(t, j),
accumulated in float32 (float64 for float64 y) in the order moe_unpermute uses, then cast
to y's dtype. Tokens without a valid entry get 0. So route -> dispatch -> experts ->
combine equals the single-process moe_permute -> experts -> moe_unpermute.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import checks as C
from . import meta
from .collectives import _a2a, _agree_tensor, _tensor
from .group import group_info

#: dtypes of the activations moe_dispatch moves and moe_combine reduces.
MOE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass(frozen=True)
class MoeDispatchHandle:
    """What moe_combine needs to route expert outputs back; produced by moe_dispatch.

    group: the process group (None: the default group).
    num_experts: E (global); every rank owns E / group size of them.
    num_tokens, top_k: T and k of this rank's ids.
    send_splits: rows this rank sent to each rank (group order).
    recv_splits: rows this rank received from each rank.
    send_src: int64 [sum(send_splits)]: flat index t*k + j of each sent row, in send order
        (expert ascending, then flat index ascending).
    recv_order: int64 [sum(recv_splits)]: recv_x[i] is the recv_order[i]-th row as received
        (received rows arrive grouped by source rank).
    recv_counts: int64 [world, E / world]: rows received from each source rank per local expert.
    weights: fp32 [T, k]: this rank's routing weights (moe_combine applies them).
    """
    group: object
    num_experts: int
    num_tokens: int
    top_k: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    send_src: torch.Tensor
    recv_order: torch.Tensor
    recv_counts: torch.Tensor
    weights: torch.Tensor


def moe_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 group=None, *, check: bool = True):
    """Sends each token's row to the ranks owning its experts.

    x: [T, D] fp32|fp16|bf16|fp64, this rank's tokens (T may differ across ranks, 0 allowed).
    ids: int32 [T, k] global expert ids; entries outside [0, num_experts) are dropped.
    weights: fp32 [T, k] routing weights (returned per row, and applied by moe_combine).
    num_experts: E, the same on every rank, divisible by the group size.
    check: exchange metadata first so that a dtype/D/E mismatch across ranks raises
        InvalidInputError on every rank (one small all_gather; see glm5_hal.dist.meta).

    Returns (recv_x [R, D] like x, recv_local_ids int32 [R] in [0, E/W),
    recv_weights fp32 [R], tokens_per_local_expert int32 [E/W], handle), rows ordered by
    local expert, then source rank, then the source's flat index t*k + j.
    """
    name = "moe_dispatch"
    info = group_info(name, group)
    world = info.size

    def local() -> list[int]:
        _tensor(name, "x", x, info, dtypes=MOE_DTYPES)
        C.shape(name, "x", x, [None, None])
        C.tensor(name, "ids", ids, ndim=2, dtypes=C.INDEX_DTYPES)
        C.shape(name, "ids", ids, [x.shape[0], None])
        if ids.shape[1] < 1:
            C.fail(name, "ids", "at least one routing entry per token (k >= 1)", f"shape {list(ids.shape)}")
        C.tensor(name, "weights", weights, ndim=2, dtypes=(torch.float32,))
        C.shape(name, "weights", weights, list(ids.shape))
        C.same_device(name, "x", x, ids=ids, weights=weights)
        C.integer(name, "num_experts", num_experts, min_value=1)
        if num_experts % world:
            C.fail(name, "num_experts", f"a multiple of the group size {world} (experts are split "
                   "contiguously over the ranks)", num_experts)
        return meta.row(name, x, world, shape=[0, x.shape[1]], a=num_experts)

    rows = meta.prologue(name, info, check, local, x)
    if rows is not None:
        _agree_tensor(name, "x", info, rows, "hidden size D")
        meta.agree(name, "num_experts", info, rows, "num_experts", lambda r: r.a)
    num_tokens, top_k = ids.shape
    per_rank = num_experts // world
    device = x.device

    flat_ids = ids.reshape(-1).to(torch.int64)
    valid = ((flat_ids >= 0) & (flat_ids < num_experts)).nonzero().squeeze(1)
    valid_ids = flat_ids.index_select(0, valid)
    order = torch.sort(valid_ids, stable=True).indices  # expert ascending, flat index ascending
    send_src = valid.index_select(0, order)
    send_counts = torch.bincount(valid_ids, minlength=num_experts).view(world, per_rank)
    recv_counts = torch.empty_like(send_counts)
    _a2a(recv_counts, send_counts, None, None, info, name + " (count exchange)")
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()

    # One all_to_all moves each row's bytes followed by its fp32 weight's 4 bytes.
    row_bytes = x.shape[1] * x.element_size()
    sent_rows = x.index_select(0, send_src // top_k).contiguous().view(torch.uint8)
    sent_weights = weights.reshape(-1).index_select(0, send_src).view(torch.uint8).view(-1, 4)
    packed = torch.cat([sent_rows, sent_weights], dim=1)
    received = packed.new_empty(sum(recv_splits), row_bytes + 4)
    _a2a(received, packed, recv_splits, send_splits, info, name)

    recv_order = _expert_major_order(recv_counts)
    recv_x = received[:, :row_bytes].index_select(0, recv_order).view(x.dtype)
    recv_weights = received[:, row_bytes:].index_select(0, recv_order).view(torch.float32).reshape(-1)
    tokens_per_local_expert = recv_counts.sum(0)
    recv_local_ids = torch.repeat_interleave(
        torch.arange(per_rank, dtype=torch.int32, device=device), tokens_per_local_expert,
        output_size=recv_x.shape[0])
    handle = MoeDispatchHandle(group, num_experts, num_tokens, top_k, tuple(send_splits),
                               tuple(recv_splits), send_src, recv_order, recv_counts, weights)
    return recv_x, recv_local_ids, recv_weights, tokens_per_local_expert.to(torch.int32), handle


def _expert_major_order(counts: torch.Tensor) -> torch.Tensor:
    """For rows received grouped by (source, local expert) with block sizes counts[s, e],
    the indices that regroup them by (local expert, source), keeping order inside blocks."""
    world, per_rank = counts.shape
    source_major = counts.reshape(-1)
    start_sm = (torch.cumsum(source_major, 0) - source_major).view(world, per_rank).t().reshape(-1)
    sizes_em = counts.t().reshape(-1)
    start_em = torch.cumsum(sizes_em, 0) - sizes_em
    total = int(source_major.sum())
    block = torch.repeat_interleave(torch.arange(world * per_rank, device=counts.device), sizes_em,
                                    output_size=total)
    position = torch.arange(total, device=counts.device)
    return start_sm.index_select(0, block) + position - start_em.index_select(0, block)


def moe_combine(y: torch.Tensor, handle: MoeDispatchHandle, *, check: bool = True) -> torch.Tensor:
    """Returns the expert outputs to their tokens and applies the routing weights.

    y: [R, H] fp32|fp16|bf16|fp64, one row per received row, in recv_x's order, the
        UNWEIGHTED expert output (moe_combine multiplies by the weights). H may differ from
        D but must be the same on every rank, as must y's dtype.
    handle: the handle moe_dispatch returned for this batch.
    check: exchange metadata first (dtype/H mismatches raise on every rank).

    Returns [T, H] in y's dtype, in this rank's original token order:
    out[t] = sum_j weights[t, j] * y_row(t, j) over t's valid entries, float32 accumulation
    (float64 for float64 y); 0 for tokens without a valid entry.
    """
    name = "moe_combine"
    if not isinstance(handle, MoeDispatchHandle):
        C.fail(name, "handle", "the MoeDispatchHandle returned by moe_dispatch", type(handle).__name__)
    info = group_info(name, handle.group)
    received_rows = sum(handle.recv_splits)

    def local() -> list[int]:
        _tensor(name, "y", y, info, dtypes=MOE_DTYPES)
        C.shape(name, "y", y, [received_rows, None])
        C.same_device(name, "handle.send_src", handle.send_src, y=y)
        return meta.row(name, y, info.size, shape=[0, y.shape[1]])

    rows = meta.prologue(name, info, check, local, y)
    if rows is not None:
        _agree_tensor(name, "y", info, rows, "output size H")
    source_major = torch.empty((received_rows, y.shape[1]), dtype=y.dtype, device=y.device)
    source_major.index_copy_(0, handle.recv_order, y)
    back = source_major.view(torch.uint8).new_empty(handle.send_src.numel(), y.shape[1] * y.element_size())
    _a2a(back, source_major.view(torch.uint8), list(handle.send_splits), list(handle.recv_splits),
         info, name)
    acc_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    routed = back.view(y.dtype).to(acc_dtype)
    scale = handle.weights.reshape(-1).index_select(0, handle.send_src).to(acc_dtype)
    out = torch.zeros((handle.num_tokens, y.shape[1]), dtype=acc_dtype, device=y.device)
    out.index_add_(0, handle.send_src // handle.top_k, routed * scale[:, None])
    return out.to(y.dtype)


def owned_experts(num_experts: int, group=None) -> range:
    """The global expert ids this rank owns: [r*E/W, (r+1)*E/W)."""
    info = group_info("owned_experts", group)
    C.integer("owned_experts", "num_experts", num_experts, min_value=1)
    if num_experts % info.size:
        C.fail("owned_experts", "num_experts", f"a multiple of the group size {info.size}", num_experts)
    per_rank = num_experts // info.size
    return range(info.rank * per_rank, (info.rank + 1) * per_rank)

