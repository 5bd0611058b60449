"""The numerics of two vLLM kernels that several vendors' op libraries port under vLLM's schema,
shared by the emulators of those libraries (dcu.py: vLLM's own `_C.rotary_embedding` on a DCU;
enflame.py: vllm-gcu's `_C` ops; iluvatar.py: ixformer's dynamic int8 quant). Each emulator
keeps its own vendor's checks around them and passes its `_require`, so a violated constraint
raises that vendor's error.

Written from vllm-project/vllm, never from glm5_hal.reference:
* csrc/pos_encoding_kernels.cu @0f5257e2 (rotary_embedding: in place on query and key; the
  cos_sin_cache row of a position holds the rot_dim/2 cosines then the sines; NeoX pairs
  (i, i + rot_dim/2), GPT-J pairs (2i, 2i + 1); the products in float32, stored in the
  tensor's dtype);
* csrc/quantization/compressed_tensors/int8_quant_kernels.cu (dynamic per-token int8: scale =
  absmax / 127, codes = round-to-nearest-even(x * (127 / absmax)) clamped to [-128, 127]).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

Require = Callable[[bool, str, str], None]


def rotary_embedding(require: Require, op: str, positions: Tensor, query: Tensor, key: Tensor | None,
                     head_size: int, cos_sin_cache: Tensor, is_neox: bool) -> None:
    """vLLM's rotary_embedding(positions, query!, key!, head_size, cos_sin_cache, is_neox), in
    place on query and key (a None key is skipped)."""
    tokens = positions.numel()
    require(positions.dtype == torch.int64, op, "positions must be int64")
    require(cos_sin_cache.dtype == query.dtype and cos_sin_cache.dim() == 2, op,
            "cos_sin_cache must be 2-D in the query's dtype")
    rot = cos_sin_cache.shape[1]
    require(rot % 2 == 0 and rot <= head_size, op, f"rot_dim {rot} must be even and <= head_size {head_size}")
    require(bool(((positions >= 0) & (positions < cos_sin_cache.shape[0])).all()), op,
            "a position beyond the cos_sin_cache rows would be read out of bounds")
    rows = cos_sin_cache[positions.reshape(-1)]
    cos, sin = rows[:, None, : rot // 2].float(), rows[:, None, rot // 2:].float()
    for name, t in (("query", query), ("key", key)):
        if t is None:
            continue
        require(t.is_contiguous() and t.shape[0] == tokens and t.numel() % (tokens * head_size) == 0, op,
                f"{name} must be contiguous [num_tokens, heads * head_size]")
        heads = t.view(tokens, -1, head_size)
        if is_neox:
            x, y = heads[..., : rot // 2], heads[..., rot // 2: rot]
        else:
            x, y = heads[..., 0:rot:2], heads[..., 1:rot:2]
        xf, yf = x.float(), y.float()
        new_x, new_y = (xf * cos - yf * sin).to(t.dtype), (yf * cos + xf * sin).to(t.dtype)
        x.copy_(new_x)
        y.copy_(new_y)


def dynamic_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM's dynamic per-row int8 quant of x [..., hidden]: (codes int8 like x, scale float32
    [..., 1]). A row of zeros multiplies by 127 / 0 = inf (0 * inf): its codes are not
    specified by any source, so they are -128 here and an adapter relying on them fails."""
    rows = x.float()
    absmax = rows.abs().amax(-1, keepdim=True)
    codes = torch.round(rows * (127.0 / absmax)).clamp(-128, 127)
    return torch.where(absmax == 0, -128.0, codes).to(torch.int8), absmax / 127.0
