"""A CPU emulator of the parts of Kunlun's xpytorch stack that glm5_hal's kunlun adapters call:
`kunlun_ops`, the vLLM-Kunlun MoE kernels in `torch.ops._C`, `torch.ops.xspeedgate_ops`, and
the CUDA-compatible device surface (`torch.cuda` answering for the XPU).

Written from the published usage and semantics: vLLM-Kunlun (vllm_kunlun/ops/_kunlun_ops.py,
its torch equivalents `_sigmoid_group_topk_norm_torch` and `_moe_pre_sorted_torch`, and the
measured notes in vllm_kunlun/ops/moe/router.py, preprocess.py and ffn.py: keyword names,
the [12, E] block_statistic histogram, the 512-expert ceiling, renormalisation), the paged
cache layout [blocks, heads, block_size, dim] of its reshape_and_cache tests, sglang-kunlun's
use of xspeedgate_ops.hadamard_transform, and the field report that moe_fc's fused SWISH_GLU
activation is wrong for M >= 1024. It models:

* keyword signatures and out-parameters (the kernels write into preallocated tensors),
* the documented limits: above 512 experts moe_sigmoid_group_topk_norm returns without
  writing its outputs (the vendor wrapper ignores the error code) and moe_pre_sorted fails;
  the softmax kernels accept 512 experts, 480 with a histogram buffer,
* a stale block_statistic (not the histogram of the ids given) is rejected,
* the SWISH_GLU defect: for M >= 1024 the fused activation returns a wrong result,
* the device surface for a configurable chip and torch version.

Violations raise `XpuOpError` (what a failing kernel's wrapper raises). It never calls
`glm5_hal.reference`; numerics are float32 like the kernels' accumulators. Features the
adapters do not use (int8 paths, quantised caches, negative-index preprocessing) raise
`NotEmulatedError`.
"""
from __future__ import annotations

import collections
import types
from typing import Sequence

import torch
from torch import Tensor

_F32, _F16, _BF16, _I8, _I32 = torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32
FLOATS = (_F32, _F16, _BF16)
MOE_MAX_EXPERTS = 512
SOFTMAX_MAX_EXPERTS_WITH_STATISTIC = 480
BLOCK_STATISTIC_ROWS = 12
SWISH_GLU_BROKEN_FROM_ROWS = 1024
HADAMARD_MAX_DIM = 32768

#: chip key -> torch.cuda.get_device_name under xpytorch (the P800 name string is
#: unconfirmed; vLLM-Kunlun's platform reports "kunlun"). "R200" is a Kunlun2 and "A100" a
#: real NVIDIA GPU, both of which the backend must refuse.
CHIPS = {
    "P800": "P800",
    "kunlun": "kunlun",
    "R200": "R200",
    "A100": "NVIDIA A100-SXM4-80GB",
}
TORCH_VERSION = "2.5.1+xpytorch"
TORCH_XMLIR_VERSION = "2.5.1.7"


class XpuOpError(RuntimeError):
    """What a failing Kunlun kernel's wrapper raises."""


class NotEmulatedError(RuntimeError):
    """A feature of the vendor kernels this emulator does not model."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise XpuOpError(f"{op}: {message}")


def _tensor(op: str, name: str, t: object, dtypes: Sequence[torch.dtype] | None = None,
            ndim: int | Sequence[int] | None = None, shape: Sequence[int] | None = None) -> Tensor:
    _require(isinstance(t, Tensor), op, f"{name} must be a Tensor, got {type(t).__name__}")
    if dtypes is not None:
        _require(t.dtype in dtypes, op, f"{name} dtype {t.dtype} not supported")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        _require(t.dim() in dims, op, f"{name} must be {'/'.join(map(str, dims))}-D, got {list(t.shape)}")
    if shape is not None:
        _require(tuple(t.shape) == tuple(shape), op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    return t


def _histogram(flat_ids: Tensor, experts: int) -> Tensor:
    """The [12, experts] block_statistic: per-expert counts of 12 contiguous chunks of the ids."""
    out = torch.zeros(BLOCK_STATISTIC_ROWS, experts, dtype=_I32)
    chunk = max(1, -(-flat_ids.numel() // BLOCK_STATISTIC_ROWS))
    for row, part in enumerate(flat_ids.split(chunk)):
        out[row] = torch.bincount(part.long(), minlength=experts).to(_I32)
    return out


class _Counted:
    """Counts calls of its public methods in `calls` (shared with the emulator)."""

    def __init__(self, calls: collections.Counter, prefix: str) -> None:
        self._calls, self._prefix = calls, prefix

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if callable(value) and not name.startswith("_"):
            calls, prefix = object.__getattribute__(self, "_calls"), object.__getattribute__(self, "_prefix")

            def counted(*args, **kwargs):
                calls[f"{prefix}.{name}"] += 1
                return value(*args, **kwargs)
            return counted
        return value


class KunlunOps(_Counted):
    """kunlun_ops (formerly xtorch_ops): the functions the adapters call."""

    def rmsnorm(self, x, weight, eps, out=None):
        op = "kunlun_ops.rmsnorm"
        _tensor(op, "x", x, FLOATS)
        # vLLM-Kunlun always hands the weight over as float32 ("weight.to(torch.float32)").
        _tensor(op, "weight", weight, (_F32,), ndim=1, shape=(x.shape[-1],))
        xf = x.float()
        y = (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + float(eps)) * weight).to(x.dtype)
        if out is None:
            return y
        _tensor(op, "out", out, (x.dtype,), shape=x.shape)
        out.copy_(y)
        return out

    def silu_and_mul(self, x, axis=-1, turn=True, out=None):
        op = "kunlun_ops.silu_and_mul"
        _tensor(op, "x", x, FLOATS)
        _require(axis in (-1, x.dim() - 1), op, f"only the last axis is supported, got axis={axis}")
        if not turn:
            raise NotEmulatedError(f"{op}: turn=False (its half order is not documented)")
        n = x.shape[-1]
        _require(n % 2 == 0, op, f"the last dim must be even, got {n}")
        xf = x.float()
        gate, up = xf[..., : n // 2], xf[..., n // 2:]
        y = (gate * torch.sigmoid(gate) * up).to(x.dtype)
        if out is None:
            return y
        _tensor(op, "out", out, (x.dtype,), shape=y.shape)
        out.copy_(y)
        return out

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping, k_max=None, v_max=None,
                          quant_mode=0, *args, **kwargs):
        op = "kunlun_ops.reshape_and_cache"
        if k_max is not None or v_max is not None or args or kwargs:
            raise NotEmulatedError(f"{op}: int8 cache quantisation")
        for name, src, cache in (("key", key, key_cache), ("value", value, value_cache)):
            if src is None and cache is None:
                continue
            _require(src is not None and cache is not None, op, f"{name} and {name}_cache come together")
            _tensor(op, name, src, FLOATS, ndim=3)
            _tensor(op, f"{name}_cache", cache, FLOATS, ndim=4)
            _require(cache.is_contiguous(), op, f"{name}_cache must be contiguous")
            _require(src.dtype == cache.dtype, op, f"{name}_cache must have {name}'s dtype")
            _require(src.shape[1] == cache.shape[1] and src.shape[2] == cache.shape[3], op,
                     f"{name} [T, heads, dim] does not fit {name}_cache [blocks, heads, block_size, dim]")
        _require(key is not None, op, "key is required")
        _tensor(op, "slot_mapping", slot_mapping, (_I32,), ndim=1, shape=(key.shape[0],))
        blocks, _, block_size, _ = key_cache.shape
        for i, slot in enumerate(int(s) for s in slot_mapping.tolist()):
            if slot < 0:            # vLLM's padding convention: nothing is written
                continue
            _require(slot < blocks * block_size, op, f"slot {slot} is outside the cache")
            key_cache[slot // block_size, :, slot % block_size] = key[i]
            if value is not None:
                value_cache[slot // block_size, :, slot % block_size] = value[i]
        return None


class OpsC(_Counted):
    """torch.ops._C: the vLLM-Kunlun MoE kernels (keyword arguments, preallocated outputs).
    `fc_acts` records the act argument of every moe_fc call."""

    def __init__(self, calls: collections.Counter, prefix: str) -> None:
        super().__init__(calls, prefix)
        self.fc_acts: list = []

    def _route_outputs(self, op, x, first, second):
        _tensor(op, "x", x, FLOATS, ndim=2)
        _require(x.is_contiguous(), op, "x must be contiguous")
        tokens = x.shape[0]
        _tensor(op, "scores", first, (_F32,), ndim=2)
        _tensor(op, "topk_index", second, (_I32,), ndim=2, shape=first.shape)
        _require(first.shape[0] == tokens, op, "outputs need one row per token")
        return first.shape[1]

    def moe_softmax_topk_norm(self, x, normed_score, topk_index, block_statistic=None, stable=True):
        self._softmax_topk("moe_softmax_topk_norm", x, normed_score, topk_index, block_statistic, True)

    def moe_softmax_topk(self, x, normed_score, topk_index, block_statistic=None, stable=True):
        self._softmax_topk("moe_softmax_topk", x, normed_score, topk_index, block_statistic, False)

    def _softmax_topk(self, op, x, normed_score, topk_index, block_statistic, renormalise):
        topk = self._route_outputs(op, x, normed_score, topk_index)
        experts = x.shape[1]
        limit = SOFTMAX_MAX_EXPERTS_WITH_STATISTIC if block_statistic is not None else MOE_MAX_EXPERTS
        _require(experts <= limit, op, f"optimized_ops::{op}_fusion failed ({experts} experts > {limit})")
        probs = torch.softmax(x.float(), dim=-1)
        values, ids = torch.topk(probs, topk, dim=-1)
        if renormalise:
            values = values / values.sum(dim=-1, keepdim=True)
        normed_score.copy_(values)
        topk_index.copy_(ids.to(_I32))
        if block_statistic is not None:
            block_statistic.copy_(_histogram(ids.reshape(-1), experts))

    def moe_sigmoid_group_topk_norm(self, x, topk_index, norm_score, block_static, bias, scale, n_group,
                                    topk_group):
        op = "moe_sigmoid_group_topk_norm"
        topk = self._route_outputs(op, x, norm_score, topk_index)
        experts = x.shape[1]
        _tensor(op, "block_static", block_static, (_I32,), shape=(BLOCK_STATISTIC_ROWS, experts))
        if experts > MOE_MAX_EXPERTS:
            return 1   # ret=1; the outputs are left as they were (vllm_kunlun/ops/_kunlun_ops.py)
        scores = torch.sigmoid(x.float())
        routing = scores
        if bias is not None:
            _tensor(op, "bias", bias, FLOATS, shape=(experts,))
            routing = scores + bias.float().view(1, -1)
        if n_group is not None and n_group > 1:
            _require(experts % n_group == 0 and 1 <= topk_group <= n_group, op, "bad n_group / topk_group")
            grouped = routing.view(x.shape[0], n_group, experts // n_group)
            group_score = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(dim=-1)
            kept = group_score.topk(topk_group, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
            routing = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(x.shape[0], experts)
        ids = routing.topk(topk, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True) * float(scale)
        topk_index.copy_(ids.to(_I32))
        norm_score.copy_(weights)
        block_static.copy_(_histogram(ids.reshape(-1), experts))
        return 0

    def gen_block_statistic(self, topk_ids, block_statistic):
        op = "gen_block_statistic"
        _tensor(op, "topk_ids", topk_ids, (_I32,), ndim=2)
        _tensor(op, "block_statistic", block_statistic, (_I32,), ndim=2)
        experts = block_statistic.shape[1]
        _require(block_statistic.shape[0] == BLOCK_STATISTIC_ROWS, op, f"block_statistic needs {BLOCK_STATISTIC_ROWS} rows")
        flat = topk_ids.reshape(-1)
        _require(flat.numel() == 0 or bool(((flat >= 0) & (flat < experts)).all()), op,
                 f"topk ids must lie in [0, {experts})")
        block_statistic.copy_(_histogram(flat, experts))

    def moe_pre_sorted(self, x, topk_index, block_statistic, moe_expand, moe_index, expert_m,
                       sorted_tokens_num_lod, index_have_neg=False):
        op = "moe_pre_sorted"
        if index_have_neg:
            raise NotEmulatedError(f"{op}: index_have_neg (where -1 rows are placed is not documented)")
        _tensor(op, "x", x, FLOATS, ndim=2)
        _tensor(op, "topk_index", topk_index, (_I32,), ndim=2)
        tokens, topk = topk_index.shape
        _require(x.shape[0] == tokens, op, "x needs one row per token")
        experts = expert_m.numel()
        _require(experts <= MOE_MAX_EXPERTS, op, f"failed with ret=2 ({experts} experts > {MOE_MAX_EXPERTS})")
        flat = topk_index.reshape(-1).long()
        _require(bool(((flat >= 0) & (flat < experts)).all()), op, f"topk ids must lie in [0, {experts})")
        _tensor(op, "block_statistic", block_statistic, (_I32,), shape=(BLOCK_STATISTIC_ROWS, experts))
        _require(torch.equal(block_statistic.sum(dim=0), torch.bincount(flat, minlength=experts).to(_I32)), op,
                 "block_statistic is not the histogram of topk_index (stale gen_block_statistic?)")
        _tensor(op, "moe_expand", moe_expand, (x.dtype,), shape=(tokens * topk, x.shape[1]))
        _tensor(op, "moe_index", moe_index, (_I32,), shape=(tokens * topk,))
        _tensor(op, "sorted_tokens_num_lod", sorted_tokens_num_lod, (_I32,), shape=(experts + 1,))
        # vLLM-Kunlun's torch equivalent: a stable sort of the slots by expert.
        order = torch.argsort(flat, stable=True)
        slot_token = torch.arange(tokens).repeat_interleave(topk)
        moe_expand.copy_(x[slot_token[order]])
        moe_index.copy_(torch.argsort(order).to(_I32))
        counts = torch.bincount(flat, minlength=experts)
        expert_m.copy_(counts.to(_I32))
        sorted_tokens_num_lod[0] = 0
        sorted_tokens_num_lod[1:].copy_(counts.cumsum(0).to(_I32))

    def moe_fc(self, x, weight, sorted_tokens_num_lod, sorted_tokens_idx, moe_topk, y, topk_ids, act=None,
               x_perchannel_max=None, w_perchannel_max=None):
        op = "moe_fc"
        self.fc_acts.append(act)
        if x_perchannel_max is not None or w_perchannel_max is not None:
            raise NotEmulatedError(f"{op}: int8 weights and activations")
        _tensor(op, "x", x, FLOATS, ndim=2)
        _tensor(op, "weight", weight, (x.dtype,), ndim=3)
        experts, n, k = weight.shape
        _require(experts <= MOE_MAX_EXPERTS, op, f"{experts} experts > {MOE_MAX_EXPERTS}")
        rows = x.shape[0]
        _require(x.shape[1] == k, op, f"x is [rows, {x.shape[1]}], weight is [experts, n, {k}]")
        _tensor(op, "sorted_tokens_num_lod", sorted_tokens_num_lod, (_I32,), shape=(experts + 1,))
        lod = [int(v) for v in sorted_tokens_num_lod.tolist()]
        _require(lod[0] == 0 and all(b >= a for a, b in zip(lod, lod[1:])) and lod[-1] <= rows, op,
                 f"sorted_tokens_num_lod must be a prefix sum from 0 to at most {rows}, got {lod}")
        _tensor(op, "topk_ids", topk_ids, (_I32,), ndim=2)
        _require(topk_ids.shape[1] == moe_topk and topk_ids.numel() == rows, op,
                 f"topk_ids must be [rows / moe_topk, moe_topk] = [{rows // max(moe_topk, 1)}, {moe_topk}]")
        _tensor(op, "sorted_tokens_idx", sorted_tokens_idx, (_I32,), shape=(rows,))
        # The routing metadata must describe the same grouping as the lod (the kernel reads
        # the rows through it); a mismatch is a caller bug, rejected here.
        row_expert = torch.repeat_interleave(torch.arange(experts), torch.tensor(lod).diff(), output_size=lod[-1])
        slot_rows = sorted_tokens_idx.long()
        _require(bool(((slot_rows >= 0) & (slot_rows < rows)).all()), op, "sorted_tokens_idx must index the rows")
        routed = slot_rows < lod[-1]
        _require(torch.equal(topk_ids.reshape(-1).long()[routed], row_expert[slot_rows[routed]]), op,
                 "topk_ids and sorted_tokens_idx disagree with sorted_tokens_num_lod")
        out = torch.zeros(rows, n)
        for e in range(experts):
            out[lod[e]:lod[e + 1]] = x[lod[e]:lod[e + 1]].float() @ weight[e].float().T
        if act is None:
            _tensor(op, "y", y, (x.dtype,), shape=(rows, n))
            y.copy_(out.to(x.dtype))
        elif act == "SWISH_GLU":
            half = n // 2
            gate, up = out[:, :half], out[:, half:]
            if rows >= SWISH_GLU_BROKEN_FROM_ROWS:
                gate, up = up, gate   # the reported defect; any wrong answer would do
            _tensor(op, "y", y, (x.dtype,), shape=(rows, half))
            y.copy_((gate * torch.sigmoid(gate) * up).to(x.dtype))
        else:
            raise XpuOpError(f"{op}: unknown act {act!r}")

    def moe_post(self, x, moe_index, normed_scale, dequant_scale, y):
        op = "moe_post"
        _tensor(op, "x", x, FLOATS, ndim=2)
        _tensor(op, "moe_index", moe_index, (_I32,), ndim=2)
        tokens, topk = moe_index.shape
        _tensor(op, "normed_scale", normed_scale, (_F32,), shape=(tokens, topk))
        _tensor(op, "dequant_scale", dequant_scale, (_F32,), shape=(tokens, topk))
        _tensor(op, "y", y, (x.dtype,), shape=(tokens, x.shape[1]))
        idx = moe_index.long()
        _require(idx.numel() == 0 or bool(((idx >= 0) & (idx < x.shape[0])).all()), op, "moe_index must index x")
        rows = x.float()[idx.reshape(-1)].view(tokens, topk, x.shape[1])
        weights = (normed_scale * dequant_scale).unsqueeze(-1)
        y.copy_((rows * weights).sum(dim=1).to(x.dtype))


class SpeedgateOps(_Counted):
    """torch.ops.xspeedgate_ops."""

    def hadamard_transform(self, x, scale=1.0):
        op = "xspeedgate_ops.hadamard_transform"
        _tensor(op, "x", x, FLOATS)
        dim = x.shape[-1]
        _require(dim <= HADAMARD_MAX_DIM and dim & (dim - 1) == 0, op,
                 f"the last dim must be a power of two <= {HADAMARD_MAX_DIM}, got {dim}")
        y = x.float().reshape(-1, dim)
        h = 1
        while h < dim:   # Sylvester order: (a, b) -> (a + b, a - b) at stride h
            y = y.view(-1, dim // (2 * h), 2, h)
            y = torch.cat((y[:, :, :1] + y[:, :, 1:], y[:, :, :1] - y[:, :, 1:]), dim=2).reshape(-1, dim)
            h *= 2
        return (y * float(scale)).view(x.shape).to(x.dtype)


class _Stream:
    cuda_stream = 0


class _CudaModule:
    """torch.cuda as xpytorch answers it for the XPUs."""

    def __init__(self, device_name: str, devices: int) -> None:
        self._name, self._devices = device_name, devices

    def is_available(self) -> bool:
        return self._devices > 0

    def device_count(self) -> int:
        return self._devices

    def get_device_name(self, device: object = None) -> str:
        return self._name

    def current_stream(self, device: object = None) -> _Stream:
        return _Stream()


class XpuEmulator:
    """The runtime a KunlunBackend reaches (`runtime.cuda`, `.torch`, `.kunlun_ops`, `.C`,
    `.xspeedgate`), for one chip. `calls` counts the vendor functions called."""
    EMULATOR = True

    def __init__(self, chip: str = "P800", *, devices: int = 8, torch_version: str = TORCH_VERSION,
                 version: str = TORCH_XMLIR_VERSION, speedgate: bool = True) -> None:
        self.device_name = CHIPS[chip]
        self.__version__ = version
        self.calls: collections.Counter = collections.Counter()
        self.cuda = _CudaModule(self.device_name, devices)
        self.torch = types.SimpleNamespace(__version__=torch_version,
                                           version=types.SimpleNamespace(cuda="11.8", hip=None), cuda=self.cuda)
        self.kunlun_ops = KunlunOps(self.calls, "kunlun_ops")
        self.C = OpsC(self.calls, "_C")
        self.xspeedgate = SpeedgateOps(self.calls, "xspeedgate_ops") if speedgate else None
        self.xspeedgate_missing = "" if speedgate else "xspeedgate_ops not installed (emulated)"

    def current_stream(self, device: torch.device) -> int:
        return int(self.cuda.current_stream(device).cuda_stream)


class KvGatherKernelStandIn:
    """A torch stand-in for the kv_cache_gather entry of backends/kunlun/csrc (its header's
    contract), so the adapter's side runs where nothing compiles XPU code."""

    def __init__(self) -> None:
        self.launches = 0

    def missing(self) -> None:
        return None

    def status(self) -> str:
        return "stand-in (tests)"

    def kv_cache_gather(self, cache, block_table, context_lens, out_offsets, out, stream) -> None:
        assert cache.is_contiguous() and block_table.is_contiguous() and out.is_contiguous()
        assert block_table.dtype == context_lens.dtype == _I32 and out_offsets.dtype == torch.int64
        assert isinstance(stream, int)
        self.launches += 1
        block_size = cache.shape[1]
        for b in range(block_table.shape[0]):
            for p in range(int(context_lens[b])):
                out[int(out_offsets[b]) + p] = cache[int(block_table[b, p // block_size]), p % block_size]

    def sparse_mla_decode_paged(self, *args, **kwargs) -> None:
        raise AssertionError("this stand-in only serves kv_cache_gather")

