"""Vendor adapter helpers of the common ops (docs/ops/common.md): rms_norm's weight cast,
apply_rope's angles and apply_rope through vLLM's rotary_embedding schema."""
from __future__ import annotations

from typing import Callable

import torch

from ..vendor_backend import dtype_name


def weight_cast_declined(x: torch.Tensor, weight: torch.Tensor, takes: str) -> str | None:
    """For a kernel that takes the norm weight in x's dtype (`takes`: "npu_rms_norm takes
    gamma"): the reason to decline when casting the weight would round it (a float32 x
    takes any weight exactly)."""
    if weight.dtype == x.dtype or x.dtype == torch.float32:
        return None
    return (f"{takes} in x's dtype; casting the {dtype_name(weight.dtype)} weight to {dtype_name(x.dtype)} "
            "would round it")


def rope_angles(positions: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """float32 [T, rot / 2]: token t's rotation angle of pair i, positions[t] * theta^(-2i/rot),
    for the vendor ops that take angles (or their cos / sin) computed by the caller."""
    exponents = torch.arange(rot // 2, device=positions.device, dtype=torch.float32) * (-2.0 / rot)
    return positions.to(torch.float32)[:, None] * torch.pow(float(theta), exponents)[None, :]


def rope_by_rotary_embedding(rotary_embedding: Callable, x: torch.Tensor, positions: torch.Tensor, theta: float,
                              interleaved: bool) -> torch.Tensor:
    """apply_rope through vLLM's `rotary_embedding(positions int64, query!, key!, head_size,
    cos_sin_cache, is_neox)` schema (torch.ops._C on a DCU's vLLM and in vllm-gcu), x [T, H, rot]."""
    tokens, heads, rot = x.shape
    if x.numel() == 0:
        return torch.empty_like(x)
    angles = rope_angles(positions, rot, theta)
    # One cache row per token (cos of the R/2 angles, then their sin), looked up by the
    # token's own index, so the cache never spans the largest position.
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()
    # The kernel rotates in its scalar type and in place: a float32 copy keeps the
    # contract's single rounding (bf16 cos/sin would miss it near cancellations)
    query = x.to(torch.float32, copy=True).reshape(tokens, heads * rot).contiguous()
    # one head, discarded: the schema's key is a Tensor! argument
    scratch_key = torch.zeros((tokens, rot), dtype=torch.float32, device=x.device)
    token_index = torch.arange(tokens, dtype=torch.int64, device=x.device)
    rotary_embedding(token_index, query, scratch_key, rot, cos_sin_cache, not interleaved)
    return query.view(tokens, heads, rot).to(x.dtype)
