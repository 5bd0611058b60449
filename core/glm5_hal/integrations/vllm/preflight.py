"""Which glm5_hal backend serves vLLM, checked when the model is built, not mid-request.

`GLM5_HAL_VLLM_BACKEND=<name>` pins the DSA ops vLLM runs to one glm5_hal backend (a vendor
engineer serving on their backend, or CI making sure the reference is never what answered).
Without it, dispatch picks as always (the best available backend for the device, the
reference as the last resort, with glm5_hal's FallbackWarning; `GLM5_HAL_STRICT=1` makes a
fallback an error).

`check_served` runs once per attention layer build: it asks glm5_hal's dispatch about each
DSA op on a tiny call of the model's dtype, head counts and widths on the worker's device and
runs it. A pinned backend that is unavailable or declines an op, a fallback under
GLM5_HAL_STRICT=1, or an op that raises, makes vLLM fail at start with glm5_hal's reasons.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Callable, ContextManager

import torch

import glm5_hal as hal
from glm5_hal import opdef
from glm5_hal.errors import HalError

__all__ = ["BACKEND_ENV", "DsaShapes", "pinned_backend", "dispatch_scope", "check_served", "NotServedError"]

BACKEND_ENV = "GLM5_HAL_VLLM_BACKEND"


class NotServedError(RuntimeError):
    """glm5_hal cannot serve this model's sparse attention on this device."""


@dataclasses.dataclass(frozen=True)
class DsaShapes:
    heads: int            # attention heads on this rank
    kv_lora_rank: int     # latent width (the value width)
    rope_dim: int         # rope part of a cache row
    index_heads: int
    index_dim: int
    index_topk: int


def pinned_backend() -> str | None:
    name = os.environ.get(BACKEND_ENV, "").strip()
    return name or None


@functools.cache
def dispatch_scope() -> Callable[[], ContextManager]:
    """A context factory for the ops' calls: the pinned backend's, or a no-op. Checks once that
    the pinned backend exists and is available (glm5_hal.use's errors)."""
    name = pinned_backend()
    if name is None:
        return contextlib.nullcontext
    try:
        with hal.use(name):
            pass
    except HalError as err:
        raise NotServedError(f"glm5_hal cannot serve DSA in vLLM ({BACKEND_ENV}={name}): {err}") from err
    return functools.partial(opdef.pinned, name)


def _sample_calls(dtype: torch.dtype, device: torch.device, s: DsaShapes):
    """(op, args) of each glm5_hal op vLLM's DSA path runs, on two sequences of a tiny cache."""
    blocks, block_size, row = 3, 4, s.kv_lora_rank + s.rope_dim
    kw = dict(device=device)
    kv_cache = torch.zeros(blocks, block_size, row, dtype=dtype, **kw)
    k_cache = torch.zeros(blocks, block_size, s.index_dim, dtype=torch.float8_e4m3fn, **kw)
    k_scale = torch.ones(blocks, block_size, dtype=torch.float32, **kw)
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, **kw)
    lens = torch.tensor([6, 3], dtype=torch.int32, **kw)
    slots = torch.tensor([5, 8], dtype=torch.int64, **kw)
    q_index = torch.randn(2, 1, s.index_heads, s.index_dim, dtype=torch.float32, **kw)   # vLLM sets the default dtype
    indices = torch.tensor([[[0, 5, -1]], [[2, -1, -1]]], dtype=torch.int32, **kw)
    return [
        ("fp8_block_quant", (torch.randn(2, s.index_dim, dtype=dtype, **kw), s.index_dim, "ue8m0")),
        ("kv_cache_write", (kv_cache, torch.randn(2, row, dtype=dtype, **kw), slots)),
        ("indexer_k_cache_write", (torch.randn(2, s.index_dim, dtype=dtype, **kw), k_cache, k_scale, slots,
                                   "ue8m0")),
        ("indexer_topk_paged", (q_index, (k_cache, k_scale), torch.rand(2, 1, s.index_heads, dtype=torch.float32, **kw), table, lens,
                                s.index_topk)),
        ("sparse_mla_decode_paged", (torch.randn(2, 1, s.heads, row, dtype=dtype, **kw), kv_cache, table, lens,
                                     indices, row ** -0.5, s.kv_lora_rank)),
    ]


@functools.cache
def check_served(dtype: torch.dtype, device: torch.device, shapes: DsaShapes) -> tuple[str, ...]:
    """Raises NotServedError with glm5_hal's reasons if this model's DSA ops cannot be served as
    configured; returns one line per op naming the backend that serves it."""
    pin = pinned_backend()
    strict = os.environ.get("GLM5_HAL_STRICT", "").strip() not in ("", "0")
    served, problems = [], []
    with dispatch_scope()():
        for op, args in _sample_calls(dtype, device, shapes):
            try:
                explanation = hal.explain(op, *args)
            except HalError as err:
                problems.append(f"{op}: {err}")
                continue
            if explanation.error or (explanation.fallback and (pin or strict)):
                problems.append(str(explanation))
                continue
            try:
                getattr(hal.ops, op)(*args)
            except HalError as err:
                problems.append(f"{op}: {err}")
                continue
            served.append(f"{op}: {explanation.chosen}" + (" (fallback)" if explanation.fallback else ""))
    if problems:
        where = f"pinned to {pin!r} ({BACKEND_ENV})" if pin else "as dispatched" + (" (GLM5_HAL_STRICT=1)" if strict else "")
        raise NotServedError(f"glm5_hal cannot serve this model's sparse attention in {dtype} on {device}, "
                             f"{where}:\n" + "\n".join(problems))
    return tuple(served)
