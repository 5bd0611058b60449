"""A CPU emulator of the parts of `torch_mlu` and `torch_mlu_ops` 1.12.1 that glm5_hal's
cambricon adapters call.

Written from the vendor's published code, the one public version of each:
* torch_mlu_ops 1.12.1+torch2.11.0 as published in miznchimaki/domesticated_torch_mlu_ops
  @9fbf7df6: the docstrings of torch_mlu_ops/_ops.py ("Math:", "Args:", "Type:", "Note:"
  sections: signatures, layouts, constraints) and the shapes of abstract.py;
* Cambricon/vllm-mlu vllm_mlu/_mlu_ops.py @8fa99fd9: how the ops are called and composed;
* Cambricon/torch_mlu @d578002c: the device module (is_bf16_supported: major >= 5,
  torch_mlu/mlu/__init__.py:135-137; Stream.mlu_stream), which has no is_fp8_supported: the
  emulated torch.mlu has one only when asked for (`fp8_query=`), standing in for a torch_mlu
  that would declare FP8 -- what such a chip does with FP8 is UNVERIFIED.
It models:

* the signatures, including positional order and keyword names,
* the vendor layouts (paged caches [blocks, heads, block_size, dim], moe_gen_idx's
  expand/combine indices and cusum ranges, the (batch + 1) cu_seqlens of pack mode),
* the documented constraints and types: a violated one raises `MluOpError` (what the real
  op raises from its parameter check), so an adapter that forgets to decline a call fails
  its test; chips without bf16 / FP8 reject those dtypes,
* outputs the docs leave undefined (rows past a cusum range, entries past a sparse
  context length) hold wrong-looking values, so an adapter that reads them fails,
* the probe surface: `mlu.is_available`, `device_count`, `get_device_name`,
  `get_device_capability`, `current_stream`, and `backends.mlu.matmul.fp32_precision`.

It never calls `glm5_hal.reference`; numerics are float32 like the kernels' accumulators.
Documented features the adapters do not use (quantised modes, residual/bias fusion,
prefill mode of the indexer, expert-parallel ranges of combine) raise `NotEmulatedError`.
"""
from __future__ import annotations

import collections
import functools
import math
import types
from typing import Sequence

import torch
from torch import Tensor

_F32, _F16, _BF16, _I8, _I32 = torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32
_FP8 = torch.float8_e4m3fn
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

#: chip key -> (torch.mlu.get_device_name, get_device_capability). The majors of MLU370 and
#: MLU590 are inferred from their arch numbers (mtp_372, mtp_592: UNVERIFIED); "cap6" stands
#: for a newer generation whose torch_mlu declares FP8 (a hypothetical is_fp8_supported()),
#: "MLU290" for an older, unsupported one.
CHIPS = {
    "MLU370": ("MLU370-X8", (3, 0)),
    "MLU590": ("MLU590", (5, 0)),
    "cap6": ("MLU (capability 6.0)", (6, 0)),
    "MLU290": ("MLU290-M5", (2, 0)),
}
TMO_VERSION = "1.12.1+torch2.11.0"        # torch_mlu_ops/_version.py of the public 1.12.1
TORCH_MLU_VERSION = "1.26.0+torch2.11.0"  # a stand-in: only reported, no behaviour keys on it


class MluOpError(RuntimeError):
    """What the real op raises when its parameter check rejects a call."""


class NotEmulatedError(RuntimeError):
    """A documented vendor feature this emulator does not model."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise MluOpError(f"torch_mlu_ops.{op}: {message}")


def _not_emulated(used: bool, op: str, feature: str) -> None:
    if used:
        raise NotEmulatedError(f"torch_mlu_ops.{op}: {feature} is not emulated")


def _tensor(op: str, name: str, t: object, dtypes: Sequence[torch.dtype] | None = None,
            ndim: int | Sequence[int] | None = None, contiguous: bool = False) -> Tensor:
    _require(isinstance(t, Tensor), op, f"{name} must be a Tensor, got {type(t).__name__}")
    if dtypes is not None:
        _require(t.dtype in dtypes, op, f"{name} dtype {t.dtype} not supported (supported: "
                 f"{', '.join(str(d) for d in dtypes)})")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        _require(t.dim() in dims, op, f"{name} must be {'/'.join(map(str, dims))}-D, got shape {list(t.shape)}")
    if contiguous:
        _require(t.is_contiguous(), op, f"{name} must be contiguous")
    return t


class _Stream:
    mlu_stream = 0


class _MluModule:
    """torch.mlu as registered by torch_mlu, for one emulated chip."""

    def __init__(self, device_name: str, capability: tuple[int, int], devices: int, fp8: bool | None) -> None:
        self._name, self._capability, self._devices = device_name, capability, devices
        self.fp8 = bool(fp8)
        if fp8 is not None:   # the public torch_mlu has no is_fp8_supported
            self.is_fp8_supported = lambda: self.fp8

    def is_available(self) -> bool:
        return self._devices > 0

    def device_count(self) -> int:
        return self._devices

    def get_device_name(self, device: object = None) -> str:
        return self._name

    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        return self._capability

    def is_bf16_supported(self) -> bool:
        return self._capability[0] >= 5

    def current_stream(self, device: object = None) -> _Stream:
        return _Stream()


class TorchMluOps:
    """The torch_mlu_ops functions the adapters call, on CPU tensors. `calls` counts them."""

    def __init__(self, mlu: _MluModule, backends: types.SimpleNamespace, version: str,
                 gen_idx_order: str = "stable") -> None:
        self._mlu, self._backends = mlu, backends
        self.__version__ = version
        # moe_gen_idx's docs fix the grouping by expert, not the order inside a group; the
        # "reversed" knob lets a test check that the adapter does not rely on it.
        self.gen_idx_order = gen_idx_order
        self.calls: collections.Counter = collections.Counter()

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if callable(value) and not name.startswith("_") and name in _TMO_OPS:
            calls = object.__getattribute__(self, "calls")

            @functools.wraps(value)
            def counted(*args, **kwargs):
                calls[name] += 1
                return value(*args, **kwargs)
            return counted
        return value

    def _device_dtype(self, op: str, t: Tensor) -> None:
        major = self._mlu.get_device_capability()[0]
        _require(t.dtype != _BF16 or major >= 5, op, f"bfloat16 is not supported on capability {major}.x "
                 "(torch.mlu.is_bf16_supported() is False)")
        _require(t.dtype != _FP8 or self._mlu.fp8, op, f"float8_e4m3fn is not supported on capability {major}.x "
                 "(no FP8 declared by torch_mlu)")

    # -- normalisation, activation, rotary ---------------------------------------------------
    def fused_rms_norm(self, x, residual, gamma, beta, bias, eps, store_output_before_norm,
                       quant_scale=None, out=None, dynamic_quant=False, store_output_after_norm=False,
                       quant_type=_I8, scale_type=_F32, mx_quant=False):
        op = "fused_rms_norm"
        _not_emulated(residual is not None or beta is not None or bias is not None, op, "residual/beta/bias fusion")
        _not_emulated(quant_scale is not None or dynamic_quant or mx_quant, op, "output quantisation")
        _not_emulated(bool(store_output_before_norm) or bool(store_output_after_norm), op, "stored intermediates")
        _tensor(op, "x", x, FLOATS)
        self._device_dtype(op, x)
        if gamma is not None:
            _tensor(op, "gamma", gamma, ndim=(1, 2))
            _require(gamma.dtype == x.dtype, op, f"gamma must have x's dtype {x.dtype}, got {gamma.dtype}")
            _not_emulated(gamma.dim() == 2, op, "per-head (2-D) gamma")
            _require(gamma.shape[0] == x.shape[-1], op, f"gamma must have shape ({x.shape[-1]}), got {list(gamma.shape)}")
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + float(eps))
        if gamma is not None:
            y = y * gamma.float()
        result = y.to(x.dtype)
        if out is not None:
            _require(out.shape == x.shape and out.dtype == x.dtype, op, "out must match x")
            out.copy_(result)
            return out
        return result

    def active(self, input, act_mode, is_gated, active_coef=1.0, high_precision=False, gelu_approximate="none"):
        op = "active"
        _tensor(op, "input", input, FLOATS)
        self._device_dtype(op, input)
        _require(act_mode in ("silu", "gelu", "swish", "quick_gelu"), op,
                 f"act_mode must be 'silu', 'gelu', 'swish' or 'quick_gelu', got {act_mode!r}")
        channels = input.shape[-1]
        _require(not is_gated or channels % 2 == 0, op, f"a gated input needs an even last dim, got {channels}")
        xf = input.float()
        if is_gated:
            gate, up = xf[..., : channels // 2], xf[..., channels // 2:]
        else:
            gate, up = xf, None
        if act_mode == "silu":
            act = gate * torch.sigmoid(gate)
        elif act_mode == "swish":
            act = gate * torch.sigmoid(float(active_coef) * gate)
        elif act_mode == "quick_gelu":
            act = gate * torch.sigmoid(1.702 * gate)
        else:
            act = torch.nn.functional.gelu(gate, approximate="tanh" if gelu_approximate == "tanh" else "none")
        return (act * up if is_gated else act).to(input.dtype)

    def apply_rotary(self, input, sin_cache, cos_cache, position_ids, cu_seqlens, interleaved, discrete,
                     dynamic_ntk, max_seqlen, output=None, is_inverse=False):
        op = "apply_rotary"
        _tensor(op, "input", input, FLOATS, ndim=(3, 4))
        self._device_dtype(op, input)
        _not_emulated(bool(dynamic_ntk), op, "dynamic_ntk")
        head_size = input.shape[-1]
        _require(2 <= head_size <= 256, op, f"head_size must be between 2 and 256, got {head_size}")
        for name, table in (("sin_cache", sin_cache), ("cos_cache", cos_cache)):
            _tensor(op, name, table, ndim=2)
            _require(table.dtype == input.dtype, op, f"{name} must have input's dtype {input.dtype}, got {table.dtype}")
        _require(sin_cache.shape == cos_cache.shape, op, "sin_cache and cos_cache must have the same shape")
        table_len, rope_dim = sin_cache.shape
        _require(rope_dim % 2 == 0 and 2 <= rope_dim <= head_size, op,
                 f"rope_dim must be even and between 2 and head_size {head_size}, got {rope_dim}")
        if input.dim() == 3:
            _require(cu_seqlens is not None, op, "cu_seqlens is required in pack mode (3-D input)")
            _tensor(op, "cu_seqlens", cu_seqlens, (_I32,), ndim=1)
            cu = [int(v) for v in cu_seqlens.tolist()]
            _require(len(cu) >= 2 and cu[0] == 0 and all(b >= a for a, b in zip(cu, cu[1:])), op,
                     f"cu_seqlens must be a prefix sum starting at 0, got {cu}")
            _require(cu[-1] == input.shape[0], op, f"cu_seqlens ends at {cu[-1]}, input has {input.shape[0]} tokens")
            _require(all(b - a <= max_seqlen for a, b in zip(cu, cu[1:])), op, "a sequence is longer than max_seqlen")
            batch, rows = len(cu) - 1, input
            starts = cu
        else:
            batch = input.shape[0]
            rows = input.reshape(-1, *input.shape[2:])
            starts = [b * input.shape[1] for b in range(batch + 1)]
        _require(batch <= 10240, op, f"batch_size must be <= 10240, got {batch}")
        total = rows.shape[0]
        if discrete:
            _tensor(op, "position_ids", position_ids, (_I32,))
            _require(position_ids.numel() == total, op, f"discrete position_ids need one id per token ({total})")
            pos = position_ids.reshape(-1).long()
        else:
            offsets = torch.zeros(batch, dtype=torch.long) if position_ids is None else position_ids.long()
            pos = torch.cat([offsets[b] + torch.arange(starts[b + 1] - starts[b]) for b in range(batch)])
        _require(bool(((pos >= 0) & (pos < table_len)).all()), op,
                 f"position ids must index the {table_len}-row sin/cos tables")
        x = rows.float()
        sin, cos = sin_cache.float()[pos][:, None, :], cos_cache.float()[pos][:, None, :]
        if is_inverse:
            sin = -sin
        part = x[..., :rope_dim]
        turned = torch.empty_like(part)
        if interleaved:
            turned[..., 0::2], turned[..., 1::2] = -part[..., 1::2], part[..., 0::2]
        else:
            half = rope_dim // 2
            turned = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
        result = x.clone()
        result[..., :rope_dim] = turned * sin + part * cos
        target = input if output is None else output
        _require(target.shape == input.shape and target.dtype == input.dtype, op, "output must match input")
        target.copy_(result.view(input.shape).to(input.dtype))
        return target

    # -- MoE -----------------------------------------------------------------------------------
    def group_gemm(self, a, b, group_list, expand_idx, c, alpha, beta, max_in_group_list, bias=None, d=None,
                   trans_a=False, trans_b=True, tile_config=None, idx_offset=None, output_dtype=None):
        op = "group_gemm"
        _not_emulated(expand_idx is not None or idx_offset is not None, op, "expand_idx gathering")
        _not_emulated(c is not None or alpha is not None or beta is not None or bias is not None, op,
                      "c/alpha/beta/bias epilogues")
        _not_emulated(bool(trans_a) or not trans_b or tile_config is not None, op, "transposed a / untransposed b / tiles")
        _tensor(op, "a", a, FLOATS, ndim=2)
        self._device_dtype(op, a)
        _tensor(op, "b", b, FLOATS, ndim=(2, 3))
        _not_emulated(b.dim() == 2, op, "the split-k (2-D b) mode")
        _require(b.dtype == a.dtype, op, f"b must have a's dtype {a.dtype}, got {b.dtype}")
        experts, n, k = b.shape
        _require(a.shape[1] == k, op, f"a is (m, {a.shape[1]}) but b is (experts, n, {k})")
        _tensor(op, "group_list", group_list, (_I32,), ndim=1)
        _require(group_list.shape[0] == experts, op, f"group_list must have {experts} entries")
        counts = [int(v) for v in group_list.tolist()]
        _require(all(v >= 0 for v in counts), op, "group_list counts must be >= 0")
        _require(sum(counts) <= a.shape[0], op, f"group_list sums to {sum(counts)} > m = {a.shape[0]}")
        _require(max(counts, default=0) <= max_in_group_list, op,
                 f"max_in_group_list {max_in_group_list} is smaller than a group ({max(counts)})")
        af, bf = a.float(), b.float()
        if a.dtype == _F32 and _tf32_allowed(self._backends):
            af, bf = _round_to_tf32(af), _round_to_tf32(bf)
        out = torch.full((a.shape[0], n), math.nan, dtype=_F32)   # rows past the groups: undefined
        start = 0
        for e, count in enumerate(counts):
            out[start:start + count] = af[start:start + count] @ bf[e].T
            start += count
        dtype = a.dtype if output_dtype is None else output_dtype
        result = out.to(dtype)
        if d is not None:
            d.copy_(result)
            return d
        return result

    def smooth_quant_group_gemm(self, a, b, m_list, expand_idx, c, alpha, beta, a_scale, b_scale, dtype, max_m,
                                bias=None, quant_flag=None, d=None, tile_config=None, a_calibration=None,
                                b_calibration=None, a_quant_bit_size=8, a_lora=None, b_lora=None, idx_offset=None,
                                is_symmetric_quant=True):
        """Math (1.12.1): a_list = a.split(m_list); d_i = matmul(a_i, b[i]) * outer(a_scale_i,
        b_scale[i]) * alpha[i] + beta[i] * c_i + bias[i] (b "must be transposed": b[i] is [n, k],
        matmul(a_i, b[i]) is a_i @ b[i]^T). Two modes are emulated: smooth quantization (int8 a
        and b, a_scale (total_m), b_scale (experts, n)) and a_groupwise-b_per_block (float8 a and
        b, a_scale (k_block, total_m), b_scale (experts, n_block, k_block), k_block * block == k,
        n_block * block == n; the per-block product is inferred from the Args, the Math shows only
        the first mode). dtype must be half or bfloat16."""
        op = "smooth_quant_group_gemm"
        _not_emulated(expand_idx is not None or idx_offset is not None, op, "expand_idx gathering")
        _not_emulated(c is not None or alpha is not None or beta is not None or bias is not None or d is not None, op,
                      "c / alpha / beta / bias / d epilogues")
        _not_emulated(quant_flag is not None or tile_config is not None or a_calibration is not None
                      or b_calibration is not None or a_lora is not None or b_lora is not None
                      or a_quant_bit_size != 8, op, "int4, calibration, lora and tile modes")
        _require(dtype in HALVES, op, f"dtype must be torch.half or torch.bfloat16, got {dtype}")
        _tensor(op, "a", a, (_I8, _FP8), ndim=2)
        self._device_dtype(op, a)
        _tensor(op, "b", b, (a.dtype,), ndim=3)
        experts, n, k = b.shape
        total_m = a.shape[0]
        _require(a.shape[1] == k, op, f"a is (m, {a.shape[1]}) but b is (experts, n, {k})")
        _tensor(op, "m_list", m_list, (_I32,), ndim=1)
        _require(m_list.shape[0] == experts, op, f"m_list must have {experts} entries")
        counts = [int(v) for v in m_list.tolist()]
        _require(all(v >= 0 for v in counts), op, "m_list entries must be >= 0")
        if sum(counts) != total_m:
            raise NotEmulatedError(f"torch_mlu_ops.{op}: rows of a past the sum of m_list are not emulated")
        _require(max(counts, default=0) <= max_m, op, f"max_m {max_m} is smaller than an m_list entry")
        if a.dtype == _I8:
            _tensor(op, "a_scale", a_scale, (_F32,), ndim=1)
            _require(a_scale.shape[0] == total_m, op, f"a_scale must be ({total_m})")
            _tensor(op, "b_scale", b_scale, (_F32,), ndim=2)
            _require(tuple(b_scale.shape) == (experts, n), op, f"b_scale must be ({experts}, {n})")
            a_deq = a.double() * a_scale.double()[:, None]
            b_deq = b.double() * b_scale.double()[:, :, None]
        else:
            _tensor(op, "a_scale", a_scale, (_F32,), ndim=2)
            _tensor(op, "b_scale", b_scale, (_F32,), ndim=3)
            k_block, n_block = a_scale.shape[0], b_scale.shape[1]
            _require(a_scale.shape[1] == total_m and tuple(b_scale.shape) == (experts, n_block, k_block), op,
                     "a_scale must be (k_block, total_m) and b_scale (experts, n_block, k_block)")
            _require(k_block > 0 and k % k_block == 0 and n_block > 0 and n % n_block == 0, op,
                     "k_block * k_block_size must be equal to k, and n_block * n_block_size to n")
            kb, nb = k // k_block, n // n_block
            a_deq = a.double() * a_scale.double().T.repeat_interleave(kb, dim=1)
            b_deq = b.double() * b_scale.double().repeat_interleave(nb, dim=1).repeat_interleave(kb, dim=2)
        out = torch.empty((total_m, n), dtype=torch.float64)
        start = 0
        for e, count in enumerate(counts):
            out[start:start + count] = a_deq[start:start + count] @ b_deq[e].T
            start += count
        return out.to(dtype)

    def _route(self, op, input, topk, normalize, num_expert_group, topk_group, mask, normed_by, route_scale,
               score_bias, reduce_weight, expert_id, func):
        _tensor(op, "input", input, FLOATS, contiguous=True)
        self._device_dtype(op, input)
        _not_emulated(mask is not None, op, "mask")
        _not_emulated(reduce_weight is not None or expert_id is not None, op, "preallocated outputs")
        _require(normed_by in ("topk_logit", f"{func}_logit"), op, f"normed_by must be 'topk_logit' or "
                 f"'{func}_logit', got {normed_by!r}")
        num_expert = input.shape[-1]
        _require(1 <= topk <= num_expert, op, f"topk must be in [1, {num_expert}], got {topk}")
        flat = input.reshape(-1, num_expert).float()
        scores = torch.softmax(flat, dim=-1) if func == "softmax" else torch.sigmoid(flat)
        original = scores
        if score_bias is not None:
            _tensor(op, "score_bias", score_bias, FLOATS)
            _require(score_bias.shape[-1] == num_expert, op, f"score_bias must end in {num_expert}")
            scores = scores + score_bias.float().reshape(-1, num_expert)
        if num_expert_group <= 1:
            if score_bias is not None:
                ids = torch.topk(scores, k=topk, dim=-1).indices
                weights = original.gather(-1, ids)
            else:
                weights, ids = torch.topk(scores, k=topk, dim=-1)
        else:
            _require(num_expert % num_expert_group == 0, op, f"{num_expert} experts do not split into "
                     f"{num_expert_group} groups")
            _require(1 <= topk_group <= num_expert_group, op, f"topk_group must be in [1, {num_expert_group}]")
            group_size = num_expert // num_expert_group
            grouped = scores.view(-1, num_expert_group, group_size)
            if func == "sigmoid" and score_bias is not None:
                group_value = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)
            else:
                group_value = grouped.max(dim=-1).values
            kept = torch.topk(group_value, k=topk_group, dim=-1).indices
            keep = torch.zeros_like(group_value, dtype=torch.bool).scatter_(-1, kept, True)
            fill = float("-inf") if func == "sigmoid" else 0.0
            masked = grouped.masked_fill(~keep.unsqueeze(-1), fill).view(-1, num_expert)
            if score_bias is not None:
                ids = torch.topk(masked, k=topk, dim=-1).indices
                weights = original.gather(-1, ids)
            else:
                weights, ids = torch.topk(masked, k=topk, dim=-1)
        if normalize:
            if normed_by == "topk_logit":
                weights = weights / weights.sum(dim=-1, keepdim=True)
            else:
                weights = weights / original.sum(dim=-1, keepdim=True)
        weights = weights * float(route_scale)
        shape = (*input.shape[:-1], topk)
        return weights.to(_F32).view(shape), ids.to(_I32).view(shape)

    def moe_softmax_topk(self, input, topk, normalize=False, num_expert_group=-1, topk_group=0, mask=None,
                         normed_by="topk_logit", route_scale=1.0, reduce_weight=None, expert_id=None,
                         score_bias=None):
        return self._route("moe_softmax_topk", input, topk, normalize, num_expert_group, topk_group, mask,
                           normed_by, route_scale, score_bias, reduce_weight, expert_id, "softmax")

    def moe_sigmoid_topk(self, input, topk, normalize=False, num_expert_group=-1, topk_group=0, mask=None,
                         normed_by="topk_logit", route_scale=1.0, score_bias=None, reduce_weight=None,
                         expert_id=None):
        return self._route("moe_sigmoid_topk", input, topk, normalize, num_expert_group, topk_group, mask,
                           normed_by, route_scale, score_bias, reduce_weight, expert_id, "sigmoid")

    def moe_gen_idx(self, expert_id, expert_num, return_token2expert_idx=False):
        op = "moe_gen_idx"
        _tensor(op, "expert_id", expert_id, (_I32,), ndim=2)
        flat = expert_id.reshape(-1).long()
        _require(flat.numel() == 0 or bool(((flat >= 0) & (flat < expert_num)).all()), op,
                 f"expert ids must be in [0, {expert_num})")
        topk = expert_id.shape[1]
        # A counting sort: stable, so rows of one expert keep ascending slot order ...
        order = torch.sort(flat, stable=True).indices
        if self.gen_idx_order == "reversed":
            # ... unless the knob asks for the opposite order inside each expert.
            order = torch.sort(flat * (flat.numel() + 1) - torch.arange(flat.numel()), stable=True).indices
        token_count = torch.bincount(flat, minlength=expert_num).to(_I32)
        cusum = torch.zeros(expert_num + 1, dtype=_I32)
        cusum[1:] = token_count.cumsum(0).to(_I32)
        expand_idx = (order // topk).to(_I32)
        combine_idx = torch.empty_like(order)
        combine_idx[order] = torch.arange(order.numel())
        outs = [expand_idx, combine_idx.to(_I32), token_count, cusum]
        if return_token2expert_idx:
            outs.append(order.to(_I32))
        return outs

    def moe_expand_input(self, input, gather_idx, cusum_token_count=None, start_expert_id=0, expert_size=0,
                         output=None):
        op = "moe_expand_input"
        _tensor(op, "input", input, FLOATS + (_I8,), ndim=2)
        self._device_dtype(op, input)
        _tensor(op, "gather_idx", gather_idx, (_I32,), ndim=1)
        _not_emulated(output is not None, op, "the in-place form")
        idx = gather_idx.long()
        if cusum_token_count is not None:
            _tensor(op, "cusum_token_count", cusum_token_count, (_I32,), ndim=1)
            last = start_expert_id + expert_size
            _require(0 <= start_expert_id and last < cusum_token_count.shape[0], op,
                     f"experts [{start_expert_id}, {last}) are outside cusum_token_count")
            idx = idx[int(cusum_token_count[start_expert_id]):int(cusum_token_count[last])]
        _require(idx.numel() == 0 or bool(((idx >= 0) & (idx < input.shape[0])).all()), op,
                 f"gather_idx must index the {input.shape[0]} input rows")
        # The output has gather_idx.size(0) rows; rows past the selected range are undefined.
        out = torch.full((gather_idx.shape[0], input.shape[1]), math.nan).to(input.dtype)
        out[: idx.numel()] = input[idx]
        return out

    def moe_combine_result(self, input, reduce_weight, gather_ids, residual, cusum_token_count, start_expert_id,
                           expert_size, bias=None, output=None):
        op = "moe_combine_result"
        _tensor(op, "input", input, FLOATS, ndim=2)
        self._device_dtype(op, input)
        _tensor(op, "reduce_weight", reduce_weight, (_F32,), ndim=2)
        _tensor(op, "gather_ids", gather_ids, (_I32,), ndim=1)
        _require(bias is None, op, "bias is not supported yet, must be None")
        _not_emulated(cusum_token_count is not None, op, "expert-parallel ranges (cusum_token_count)")
        tokens, topk = reduce_weight.shape
        _require(gather_ids.shape[0] == tokens * topk, op, f"gather_ids must have num_token * topk = {tokens * topk}"
                 " entries")
        _require(input.shape[0] == tokens * topk, op, f"input must have num_token * topk = {tokens * topk} rows")
        ids = gather_ids.long()
        _require(ids.numel() == 0 or bool(((ids >= 0) & (ids < input.shape[0])).all()), op,
                 "gather_ids must index the input rows")
        rows = input.float()[ids].view(tokens, topk, input.shape[1])
        out = (rows * reduce_weight.unsqueeze(-1)).sum(dim=1)
        if residual is not None:
            out = out + residual.float()
        result = out.to(input.dtype)
        if output is not None:
            output.copy_(result)
            return output
        return result

    # -- KV cache ------------------------------------------------------------------------------
    def _slots(self, op: str, slot_mapping: Tensor, tokens: int, capacity: int) -> list[int]:
        _tensor(op, "slot_mapping", slot_mapping, (_I32,), ndim=1)
        _require(slot_mapping.shape[0] == tokens, op, f"slot_mapping must have {tokens} entries")
        slots = [int(v) for v in slot_mapping.tolist()]
        _require(all(s < capacity for s in slots), op, f"slot ids must be < {capacity} (block_num * block_size)")
        return slots

    def reshape_paged_cache(self, k, v, k_cache, v_cache, slot_mapping, direction=False):
        op = "reshape_paged_cache"
        _not_emulated(bool(direction), op, "gathering (direction=True)")
        copy_types = FLOATS + (_I8,)
        for key, cache, label in ((k, k_cache, "k"), (v, v_cache, "v")):
            if key is None and cache is None:
                continue
            _require(key is not None and cache is not None, op, f"{label} and {label}_cache come together")
            _tensor(op, label, key, copy_types, ndim=3)
            _tensor(op, f"{label}_cache", cache, copy_types, ndim=4, contiguous=True)
            self._device_dtype(op, key)
            _require(key.dtype == cache.dtype, op, f"{label}_cache must have {label}'s dtype")
            _require(key.shape[1] == cache.shape[1] and key.shape[2] == cache.shape[3], op,
                     f"{label} (num_token, heads, dim) does not fit {label}_cache (blocks, heads, block_size, dim)")
        blocks, _, block_size, _ = k_cache.shape
        slots = self._slots(op, slot_mapping, k.shape[0], blocks * block_size)
        for i, slot in enumerate(slots):
            if slot >= 0:
                k_cache[slot // block_size, :, slot % block_size, :] = k[i]
                if v is not None:
                    v_cache[slot // block_size, :, slot % block_size, :] = v[i]
        return (k_cache, v_cache) if v_cache is not None else k_cache

    def reshape_from_cache(self, key, value, key_cache, value_cache, context_lengths, max_context_len,
                           context_seq_offset=None, block_tables=None, cache_seq_offset=None):
        op = "reshape_from_cache"
        _not_emulated(value is not None or value_cache is not None, op, "values")
        _not_emulated(block_tables is None or cache_seq_offset is not None, op, "the linear cache mode")
        copy_types = FLOATS + (_I8,)
        _tensor(op, "key", key, copy_types, ndim=3)
        _tensor(op, "key_cache", key_cache, copy_types, ndim=4, contiguous=True)
        self._device_dtype(op, key)
        _require(key.dtype == key_cache.dtype, op, "key must have key_cache's dtype")
        blocks, heads, block_size, dim = key_cache.shape
        _require(key.shape[1:] == (heads, dim), op, f"key must be (total_length, {heads}, {dim})")
        _tensor(op, "context_lengths", context_lengths, (_I32,), ndim=1)
        _tensor(op, "block_tables", block_tables, (_I32,), ndim=2)
        lens = [int(v) for v in context_lengths.tolist()]
        _require(block_tables.shape[0] == len(lens), op, "block_tables needs one row per batch")
        _require(all(0 <= n <= max_context_len for n in lens), op,
                 f"context lengths must lie in [0, max_context_len = {max_context_len}]")
        starts = [sum(lens[:b]) for b in range(len(lens))]
        if context_seq_offset is not None:
            starts = [int(v) for v in context_seq_offset.tolist()]
        for b, n in enumerate(lens):
            for p in range(n):
                block = int(block_tables[b, p // block_size])
                _require(0 <= block < blocks, op, f"block_tables[{b}, {p // block_size}] = {block} is not a block")
                _require(starts[b] + p < key.shape[0], op, "key is too short for the context lengths")
                key[starts[b] + p] = key_cache[block, :, p % block_size, :]
        return None

    # -- DSA indexer ---------------------------------------------------------------------------
    def masked_indexer_select_paged_kv(self, query, k_cache, weights, kv_cache_block_table, cu_seq_q_lens,
                                       cu_seq_k_lens, k_context_lens, k_cache_block_table, is_prefill, index_topk,
                                       kv_cache_block_size, softmax_scale, q_scale=None, k_scale_cache=None,
                                       sparse_block_table=None, sparse_context_lens=None, is_score_float=False,
                                       compress_ratio=1, kv_cache_block_table_offset=None):
        op = "masked_indexer_select_paged_kv"
        _not_emulated(bool(is_prefill), op, "prefill mode")
        _not_emulated(compress_ratio != 1 or kv_cache_block_table_offset is not None, op, "compressed keys / offsets")
        _not_emulated(q_scale is not None or k_scale_cache is not None, op, "quantised queries and keys")
        _not_emulated(kv_cache_block_size != 1, op, "block-level selection (kv_cache_block_size > 1)")
        _tensor(op, "query", query, HALVES + (_I8, _FP8), ndim=4, contiguous=True)
        self._device_dtype(op, query)
        _not_emulated(query.dtype in (_I8, _FP8), op, "quantised queries")
        batch, seq_q, heads, dim = query.shape
        _require(heads in (32, 64), op, f"head_num must be 64 or 32, got {heads}")
        _require(dim == 128, op, f"head_size must be 128, got {dim}")
        _tensor(op, "k_cache", k_cache, HALVES + (_I8, _FP8), ndim=4)
        _require(k_cache.dtype == query.dtype, op, "a float k_cache must have the query's dtype")
        blocks, one, block_size, kdim = k_cache.shape
        _require(one == 1 and kdim == dim, op, "k_cache must be (total_k_block_num, 1, k_block_size, 128)")
        _tensor(op, "weights", weights, (_BF16, _F32), ndim=4)
        _require(weights.shape == (batch, seq_q, heads, 1), op, f"weights must be ({batch}, {seq_q}, {heads}, 1)")
        _tensor(op, "kv_cache_block_table", kv_cache_block_table, (_I32,), ndim=2, contiguous=True)
        _tensor(op, "k_context_lens", k_context_lens, (_I32,), ndim=1, contiguous=True)
        _tensor(op, "k_cache_block_table", k_cache_block_table, (_I32,), ndim=2, contiguous=True)
        _require(k_context_lens.shape[0] == batch and k_cache_block_table.shape[0] == batch
                 and kv_cache_block_table.shape[0] == batch, op, "the tables and lengths need one row per batch")
        _require(index_topk >= 1, op, "index_topk must be >= 1")
        scale = float(torch.tensor(softmax_scale, dtype=_F32))  # "converted to float32 internally"
        selected = torch.zeros(batch, seq_q, index_topk, dtype=_I32)  # entries past a count: undefined
        counts = torch.zeros(batch * seq_q, dtype=_I32)
        for b in range(batch):
            length = int(k_context_lens[b])
            need = -(-length // block_size)
            _require(need <= k_cache_block_table.shape[1], op, f"k_cache_block_table is too short for batch {b}")
            table = k_cache_block_table[b, :need].long()
            _require(bool(((table >= 0) & (table < blocks)).all()), op, f"a block id of batch {b} is out of range")
            keys = k_cache[table, 0].reshape(-1, dim)[:length].float()
            for i in range(seq_q):
                visible = max(length - seq_q + i + 1, 0)
                if visible == 0:
                    continue
                dots = torch.relu(query[b, i].float() @ keys[:visible].T)            # [heads, visible]
                head_w = weights[b, i, :, 0].float() * scale
                logits = (dots * head_w[:, None]).sum(dim=0)
                if not is_score_float:
                    logits = logits.to(_BF16).float()
                n = min(index_topk, visible)
                top = torch.topk(logits, n).indices
                _require(visible <= kv_cache_block_table.shape[1], op, "kv_cache_block_table is too short")
                selected[b, i, :n] = kv_cache_block_table[b, top]
                counts[b * seq_q + i] = n
        if sparse_block_table is not None:
            sparse_block_table.copy_(selected)
            selected = sparse_block_table
        if sparse_context_lens is not None:
            sparse_context_lens.copy_(counts)
            counts = sparse_context_lens
        return selected, counts


_TMO_OPS = frozenset(name for name in vars(TorchMluOps) if not name.startswith("_"))


def _tf32_allowed(backends) -> bool:
    precision = backends.mlu.matmul.fp32_precision
    return precision == "tf32" or (precision == "none" and backends.fp32_precision == "tf32")


def _round_to_tf32(t: Tensor) -> Tensor:
    """float32 rounded to TF32's 10-bit mantissa (round to nearest even on the dropped bits)."""
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return rounded.view(_F32)


class MluEmulator:
    """The runtime a CambriconBackend reaches (`runtime.mlu`, `.tmo`, `.backends`), for one chip."""
    EMULATOR = True

    def __init__(self, chip: str = "MLU590", *, devices: int = 8, tmo_version: str = TMO_VERSION,
                 version: str = TORCH_MLU_VERSION, fp32_precision: str = "none",
                 gen_idx_order: str = "stable", fp8_query: bool | None | str = "by chip") -> None:
        """`fp8_query`: what a torch.mlu.is_fp8_supported() answers (None: the function is
        absent, as in the public torch_mlu); "by chip": True for "cap6", absent otherwise."""
        name, capability = CHIPS[chip]
        self.device_name, self.capability = name, capability
        self.__version__ = version
        if fp8_query == "by chip":
            fp8_query = True if chip == "cap6" else None
        self.mlu = _MluModule(name, capability, devices, fp8_query)
        self.backends = types.SimpleNamespace(
            mlu=types.SimpleNamespace(matmul=types.SimpleNamespace(fp32_precision=fp32_precision)),
            fp32_precision="none")
        self.tmo = TorchMluOps(self.mlu, self.backends, tmo_version, gen_idx_order)

    def current_queue(self, device: torch.device) -> int:
        return int(self.mlu.current_stream(device).mlu_stream)
