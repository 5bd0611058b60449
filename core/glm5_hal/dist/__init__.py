"""Collectives and expert-parallel MoE dispatch over torch.distributed (docs/distributed.md).

    import glm5_hal as hal
    hal.dist.init_process_group()            # backend from the device: gloo, hccl, nccl, ...
    y = hal.dist.all_gather(x, dim=1)        # uneven sizes and any dtype work
    recv_x, local_ids, w, counts, handle = hal.dist.moe_dispatch(x, ids, weights, num_experts)
    out = hal.dist.moe_combine(expert_out, handle)

Every collective returns a new tensor and leaves its input untouched. See
docs/distributed.md for setting up tensor- and expert-parallel groups on each vendor.
"""
from __future__ import annotations

from .collectives import REDUCE_DTYPES, REDUCE_OPS, all_gather, all_reduce, all_to_all, broadcast, reduce_scatter
from .group import (CollectiveError, CollectiveTimeoutError, backend_for_device, check_backend_usable,
                    destroy_process_group, init_process_group)
from .moe import MOE_DTYPES, MoeDispatchHandle, moe_combine, moe_dispatch, owned_experts

__all__ = [
    "init_process_group", "destroy_process_group", "backend_for_device", "check_backend_usable",
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
    "moe_dispatch", "moe_combine", "MoeDispatchHandle", "owned_experts",
    "CollectiveError", "CollectiveTimeoutError", "REDUCE_DTYPES", "REDUCE_OPS", "MOE_DTYPES",
]
