"""What `glm5_hal.integrations.vllm.register()` does in each vLLM process."""
from __future__ import annotations

import functools
import warnings

import torch

from . import ATTENTION_BACKEND, TESTED_VERSIONS

__all__ = ["register_all", "UntestedVLLMWarning", "per_token_group_quant_fp8"]

_registered = False


class UntestedVLLMWarning(UserWarning):
    """The installed vLLM is not a release this integration was tested with."""


def register_all() -> None:
    global _registered
    if _registered:
        return
    import vllm
    if vllm.__version__.split("+")[0] not in TESTED_VERSIONS:
        warnings.warn(f"glm5_hal's vLLM integration is tested with vLLM {', '.join(TESTED_VERSIONS)}; "
                      f"this is {vllm.__version__}: its attention, indexer and platform internals may differ",
                      UntestedVLLMWarning, stacklevel=2)
    from vllm.v1.attention.backends.registry import register_backend
    register_backend(ATTENTION_BACKEND, "glm5_hal.integrations.vllm.attention.Glm5HalSparseMLABackend")
    from . import indexer  # noqa: F401  (registers the out-of-tree SparseAttnIndexer)
    _fill_fp8_group_quant_gap()
    _registered = True


def _fill_fp8_group_quant_gap() -> None:
    """vLLM 0.32's DSA indexer quantizes its queries with `per_token_group_quant_fp8`
    (model_executor/models/deepseek_v2.py, Indexer.forward), which runs a CUDA/XPU op or a
    Triton kernel; a platform with neither (vLLM's CPU build ships no Triton CPU backend)
    fails there. The indexer module's reference to it is wrapped so that exactly those calls
    run glm5_hal's `fp8_block_quant` (the same per-group e4m3 rule); every other call is
    vLLM's own."""
    from vllm.model_executor.models import deepseek_v2
    original = deepseek_v2.per_token_group_quant_fp8
    if getattr(original, "glm5_hal_wrapped", False):
        return

    @functools.wraps(original)
    def wrapped(x, group_size, eps=1e-10, dtype=None, column_major_scales=False,
                tma_aligned_scales=False, out_q=None, use_ue8m0=None):
        if _needs_hal_quant(x) and not (column_major_scales or tma_aligned_scales or out_q is not None
                                        or dtype not in (None, torch.float8_e4m3fn)):
            return per_token_group_quant_fp8(x, group_size, use_ue8m0=bool(use_ue8m0))
        return original(x, group_size, eps, dtype, column_major_scales, tma_aligned_scales, out_q, use_ue8m0)

    wrapped.glm5_hal_wrapped = True
    deepseek_v2.per_token_group_quant_fp8 = wrapped


def _needs_hal_quant(x: torch.Tensor) -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    return not HAS_TRITON and not (current_platform.is_cuda_alike() or current_platform.is_xpu())


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, *, use_ue8m0: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn like x, float32 scales [..., K / group_size]): each group of
    `group_size` consecutive elements of the last dim shares one scale (amax / 448, a power of
    two when use_ue8m0), glm5_hal's fp8_block_quant."""
    import glm5_hal as hal
    from .preflight import dispatch_scope
    with dispatch_scope()():
        return hal.ops.fp8_block_quant(x, group_size, "ue8m0" if use_ue8m0 else None)
