"""Vendor adapter helpers of the MoE ops (docs/ops/moe.md): routing a vendor kernel's
scores safely, expert ids a kernel wants in range, the contract's row order after a
vendor's permute, and unpermute's one-row-per-pair check."""
from __future__ import annotations

import torch

from ..vendor_backend import host_reads_allowed

#: Below this logit sigmoid(x) < 2e-35: float32 scores head for underflow, and a row whose
#: selected scores are all 0 renormalises to 0/0 in a vendor kernel that divides by the plain
#: sum (the contract adds 1e-20).
SIGMOID_MIN_LOGIT = -80.0


def sigmoid_underflow(logits: torch.Tensor, kernel: str) -> str | None:
    """The reason to decline a renormalised sigmoid routing whose float32 scores may be 0.
    A data check: on a device it runs only under GLM5_HAL_CHECKS=full (reading the logits
    would synchronise), so there logits this extreme reach the kernel unseen by default."""
    if logits.numel() and host_reads_allowed(logits) and bool(logits.min() < SIGMOID_MIN_LOGIT):
        return (f"logits below {SIGMOID_MIN_LOGIT:g}: their float32 sigmoid scores underflow, and {kernel} "
                "renormalises by a plain sum (0/0 is NaN; the contract adds 1e-20)")
    return None


def no_permuted_rows(x: torch.Tensor, ids: torch.Tensor, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_permute's result when there is no (token, slot) pair to route."""
    return (x.new_empty((0, x.shape[1])), ids.new_zeros(num_experts, dtype=torch.int32),
            ids.new_empty(0, dtype=torch.int32))


def spare_expert_ids(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, int]:
    """For a kernel that wants every id in [0, expert_num): int32 ids where the ones the
    contract drops (-1, other ranks' experts) go to one spare expert `num_experts`, sorted
    after the real ones, and the expert count to pass: always num_experts + 1 (whether any id
    is dropped is device data; the spare expert's group is simply empty when none is)."""
    dropped = (ids < 0) | (ids >= num_experts)
    return torch.where(dropped, num_experts, ids).to(torch.int32).contiguous(), num_experts + 1


def permuted_in_contract_order(x_perm: torch.Tensor, slot_to_row: torch.Tensor, tokens_per_expert: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_permute's (x_perm, tokens_per_expert, src) from a kernel's expert-grouped rows
    (the kept ones, x_perm) and its map from flat (token, slot) index to row: src inverts the
    map, and rows are reordered to ascending flat index within each expert where the kernel
    left them otherwise (the vendors document the grouping, not the order inside a group)."""
    slots, rows = slot_to_row.numel(), x_perm.shape[0]
    src = torch.empty(slots, dtype=torch.int32, device=slot_to_row.device)
    src[slot_to_row.long().view(-1)] = torch.arange(slots, dtype=torch.int32, device=slot_to_row.device)
    src = src[:rows]
    if rows < 2:
        return x_perm, tokens_per_expert, src
    # Whether the kernel's rows are already in that order is device data: sorted always (a
    # gather of the rows), rather than read back to skip it.
    experts = torch.arange(tokens_per_expert.shape[0], device=src.device)
    expert_of_row = torch.repeat_interleave(experts, tokens_per_expert.long(), output_size=rows)
    order = torch.argsort(expert_of_row * slots + src.long())
    return x_perm[order], tokens_per_expert, src[order]


def repeated_slot(src: torch.Tensor, slots: int, kernel: str) -> str | None:
    """The reason to decline an unpermute whose src repeats a (token, slot) pair, for a
    kernel that combines one row per pair. A data check: on a device it runs only under
    GLM5_HAL_CHECKS=full (moe_permute's src never repeats a pair)."""
    if src.numel() < 2 or not host_reads_allowed(src):
        return None
    if bool((torch.bincount(src.long(), minlength=slots) > 1).any()):
        return f"src repeats a (token, slot) index; {kernel} combines one row per pair"
    return None
