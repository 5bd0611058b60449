"""Adapters from glm5_hal's canonical ops to what a Hygon DCU offers: lightop (Hygon's fused
ops), vLLM's `_C` ops, torch's own ROCm kernels, and the backend's HIP kernels.

Each adapter is `fn(backend, <the op's parameters>)`, listed in ADAPTERS, which every
DcuBackend instance binds to itself; it reaches the vendor through `backend.runtime`
(DcuRuntime over the real modules, or the emulator in tests), so several instances coexist.
Inputs arrive validated by glm5_hal.ops; an adapter converts layouts and index conventions,
calls the vendor function and returns exactly the canonical outputs. Each adapter's predicate
returns a reason when the call is outside what the vendor function takes (dtype, a missing
package, kernels not built), so dispatch moves on.

Where lightop keeps each function depends on its version (arch.LIGHTOP_LAYOUT: lightop.op or
the top level before LightOp 0.6, lightop.norm / activation / attention from 0.6); a version outside the
verified range declines the lightop adapters. lightop's per-row top-k follows vLLM's
top_k_per_row_prefill (csrc/sampler.cu @00e831b2: -1 in the slots past a short row); the
adapters pre-fill -1 and keep only in-row indices anyway, which costs two elementwise ops
and removes any dependence on the closed kernel's tail handling (UNVERIFIED for lightop).
No adapter reads device data on the host per call. README.md has the table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from glm5_hal.backends._cuda_dialect import adapters as gpu
from glm5_hal.backends._cuda_dialect import per_row_topk
from glm5_hal.vendor_backend import Adapter, Verdict, dtype_name, first_reason
from glm5_hal.vendor_ops.common import rope_by_rotary_embedding
from glm5_hal.vendor_ops.dsa import SPARSE_MLA_DECODE_PAGED

from . import arch
from .runtime import lightop_function

if TYPE_CHECKING:
    from . import DcuBackend

_F32, _F16, _BF16, _I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "lightop rmsnorm_forward_autograd": "bf16/fp16 (the dtypes vLLM's DCU plugin runs it with), weight in x's dtype, "
                                        f"hidden size >= {arch.LIGHTOP_RMSNORM_MIN_COLS}",
    "lightop silu_and_mul_opt": "bf16/fp16; other dtypes use the DCU kernel when built",
    "lightop top_k_per_row_prefill": "float32 logits rows; slots outside a row's keys kept at -1",
    "lightop versions": "module layout read for lightop up to 0.6.0 (arch.LIGHTOP_LAYOUT); others are declined",
    "vLLM _C rotary_embedding": "in place on a float32 copy (float32 cos/sin); both pair layouts",
    "torch._grouped_mm": "probed once per dtype on the device (upstream ROCm torch limits its fast path to "
                         "MI300-class GPUs)",
    **gpu.KERNEL_LIMITS,
}


def _places(backend: "DcuBackend", function: str) -> tuple:
    """Where the installed lightop keeps `function` (a field of arch.LightopLayout)."""
    layout = backend.behaviour("lightop_layout")
    return getattr(layout, function) if layout is not None else ()


def _lightop_declined(backend: "DcuBackend", function: str, what: str) -> str | None:
    runtime = backend.runtime
    if runtime.lightop is None:
        return runtime.lightop_missing
    unverified = backend.unverified("lightop_layout")
    if unverified:
        return unverified
    if lightop_function(runtime.lightop, _places(backend, function)) is None:
        where = " / ".join(f"lightop.{module}" if module else "lightop (top level)"
                           for module, _ in _places(backend, function))
        return f"lightop has no {what} (looked in {where})"
    return None


def _lightop(backend: "DcuBackend", function: str):
    return lightop_function(backend.runtime.lightop, _places(backend, function))


# -- lightop: rms_norm, silu_and_mul -------------------------------------------------------------
def rms_norm_supported(backend: "DcuBackend", x: Tensor, weight: Tensor, eps: float) -> Verdict:
    return first_reason(
        lambda: None if x.shape[-1] >= arch.LIGHTOP_RMSNORM_MIN_COLS else
        f"lightop's RMSNorm rejects reductions narrower than one wave ({arch.LIGHTOP_RMSNORM_MIN_COLS}); vLLM's DCU "
        f"plugin routes hidden sizes below it elsewhere, got {x.shape[-1]}",
        lambda: _lightop_declined(backend, "rms_norm", "rmsnorm_forward_autograd"),
        lambda: None if weight.dtype == x.dtype else
        f"lightop's RMSNorm takes the weight in x's dtype; casting the {dtype_name(weight.dtype)} weight to "
        f"{dtype_name(x.dtype)} would round it")


def rms_norm(backend: "DcuBackend", x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    fn = _lightop(backend, "rms_norm")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return fn(rows, weight.contiguous(), float(eps), False).view(x.shape)


def _silu_route(backend: "DcuBackend", x: Tensor) -> tuple[str | None, str]:
    lightop = _lightop_declined(backend, "silu_and_mul", "silu_and_mul_opt")
    if lightop is None and x.dtype in HALVES:
        return "lightop", ""
    kernel = backend.kernels.missing()
    if kernel is None:
        return "kernel", ""
    lightop = lightop or f"lightop's silu_and_mul_opt is offered for bf16/fp16, not {dtype_name(x.dtype)}"
    return None, f"{lightop}; {kernel}"


def silu_and_mul_supported(backend: "DcuBackend", x: Tensor) -> Verdict:
    path, reason = _silu_route(backend, x)
    return True if path else reason


def silu_and_mul(backend: "DcuBackend", x: Tensor) -> Tensor:
    path, _ = _silu_route(backend, x)
    if path == "kernel":
        return gpu.silu_and_mul(backend, x)
    half = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], half))
    if out.numel() == 0:
        return out
    fn = _lightop(backend, "silu_and_mul")
    fn(out.view(-1, half), x.reshape(-1, x.shape[-1]).contiguous())
    return out


# -- vLLM _C: apply_rope ---------------------------------------------------------------------------
def apply_rope_supported(backend: "DcuBackend", x: Tensor, positions: Tensor, theta: float,
                         interleaved: bool) -> Verdict:
    runtime = backend.runtime
    return True if runtime.vllm_ops is not None else runtime.vllm_ops_missing


def apply_rope(backend: "DcuBackend", x: Tensor, positions: Tensor, theta: float, interleaved: bool) -> Tensor:
    return rope_by_rotary_embedding(backend.runtime.vllm_ops.rotary_embedding, x, positions, theta, interleaved)


# -- torch's own ROCm kernels: grouped_gemm --------------------------------------------------------
def _grouped_mm_declined(backend: "DcuBackend", x: Tensor) -> str | None:
    """Whether torch._grouped_mm runs on this device for x's dtype, found once per backend
    with a 16 x 16 call: ROCm builds of torch may run it only on some GPUs."""
    verdicts = backend.grouped_mm_verdicts
    key = (x.device.type, x.dtype)
    if key not in verdicts:
        torch_ns = backend.runtime.torch
        try:
            a = torch.ones((2, 16), dtype=x.dtype, device=x.device)
            b = torch.ones((1, 16, 16), dtype=x.dtype, device=x.device)
            got = gpu.grouped_mm(torch_ns, a, b, torch.tensor([2], dtype=_I32, device=x.device))
            verdicts[key] = None if bool((got.float() == 16).all()) else \
                f"torch._grouped_mm gave a wrong {dtype_name(x.dtype)} result on this device"
        except Exception as exc:  # the device's answer is the capability
            verdicts[key] = (f"torch._grouped_mm does not run here for {dtype_name(x.dtype)}: "
                             f"{type(exc).__name__}: {exc}")
    return verdicts[key]


def grouped_gemm_supported(backend: "DcuBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Verdict:
    if not callable(getattr(backend.runtime.torch, "_grouped_mm", None)):
        return "torch._grouped_mm is not in this torch (it needs torch >= 2.8)"
    return _grouped_mm_declined(backend, x) or True


def grouped_gemm(backend: "DcuBackend", x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    return gpu.grouped_mm(backend.runtime.torch, x, w, tokens_per_expert)


# -- indexer: HIP kernel, else torch logits + lightop's per-row top-k ------------------------------
def _lightop_topk(backend: "DcuBackend"):
    """lightop's top_k_per_row_prefill, a closed port of vLLM's: per_row_topk keeps only the
    slots inside each row, whatever it writes past a short one."""
    return _lightop(backend, "top_k")


def _indexer_route(backend: "DcuBackend", q: Tensor) -> tuple[str | None, str]:
    kernel = backend.kernels.missing() or gpu.indexer_shape_declined(q)
    if kernel is None:
        return "kernel", ""
    lightop = _lightop_declined(backend, "top_k", "top_k_per_row_prefill")
    if lightop is None:
        return "lightop", ""
    return None, f"{kernel}; {lightop}"


def indexer_topk_supported(backend: "DcuBackend", q: Tensor, k: Any, weights: Tensor, k_start: Tensor,
                           k_end: Tensor, topk: int) -> Verdict:
    path, reason = _indexer_route(backend, q)
    return True if path else reason


def indexer_topk(backend: "DcuBackend", q: Tensor, k: Any, weights: Tensor, k_start: Tensor, k_end: Tensor,
                 topk: int) -> Tensor:
    path, _ = _indexer_route(backend, q)
    if path == "kernel":
        return gpu.indexer_topk(backend, q, k, weights, k_start, k_end, topk)
    return per_row_topk.indexer_topk(_lightop_topk(backend), q, k, weights, k_start, k_end, topk)


def indexer_topk_paged_supported(backend: "DcuBackend", q: Tensor, k_cache: Any, weights: Tensor,
                                 block_table: Tensor, context_lens: Tensor, topk: int) -> Verdict:
    path, reason = _indexer_route(backend, q)
    return True if path else reason


def indexer_topk_paged(backend: "DcuBackend", q: Tensor, k_cache: Any, weights: Tensor, block_table: Tensor,
                       context_lens: Tensor, topk: int) -> Tensor:
    path, _ = _indexer_route(backend, q)
    if path == "kernel":
        return gpu.indexer_topk_paged(backend, q, k_cache, weights, block_table, context_lens, topk)
    return per_row_topk.indexer_topk_paged(_lightop_topk(backend), q, k_cache, weights, block_table, context_lens,
                                           topk)


ADAPTERS = (
    Adapter("rms_norm", rms_norm, dtypes=HALVES, supports_metadata=rms_norm_supported),
    Adapter("silu_and_mul", silu_and_mul, dtypes=FLOATS, supports_metadata=silu_and_mul_supported),
    Adapter("apply_rope", apply_rope, dtypes=FLOATS, supports_metadata=apply_rope_supported),
    Adapter("grouped_gemm", grouped_gemm, dtypes=FLOATS, supports_metadata=grouped_gemm_supported),
    Adapter("indexer_topk", indexer_topk, dtypes=FLOATS, supports_metadata=indexer_topk_supported),
    Adapter("indexer_topk_paged", indexer_topk_paged, dtypes=FLOATS, supports_metadata=indexer_topk_paged_supported),
    # sparse MLA: the HIP kernel
    gpu.SPARSE_MLA_ATTENTION, SPARSE_MLA_DECODE_PAGED,
    gpu.KV_CACHE_WRITE, gpu.MOE_PERMUTE, gpu.MOE_UNPERMUTE,
)
