"""A CPU emulator of the parts of Kunlun's xpytorch stack that glm5_hal's kunlun adapters call:
`kunlun_ops`, the vLLM-Kunlun kernels in `torch.ops._C`, `torch.ops.xspeedgate_ops`, and the
CUDA-compatible device surface (`torch.cuda` answering for the XPU), as one of the public
vLLM-Kunlun versions registers them (`XpuEmulator(vllm_kunlun="0.11.0")`).

kunlun_ops and xspeedgate_ops are closed; everything here is written from how baidu/vLLM-Kunlun
declares and calls them, at v0.10.1.1 (ba13599), v0.11.0 (e9f0322) and main (09869ee,
0.15.1.dev0):
* the `_C` schemas: vllm_kunlun/vllm_utils_wrapper.py (v0.10.1.1, v0.11.0) and
  vllm_kunlun/ops/_custom_ops.py (main): moe_softmax_topk(x, normed_score, topk_index,
  block_statistic, axis=-1, turn=True) (no `stable`), moe_softmax_topk_norm(..., stable=True),
  moe_sigmoid_group_topk_norm (bias a plain Tensor), gen_block_statistic, moe_pre_sorted,
  moe_fc (topk_ids Optional, default None), moe_post, and from v0.11.0 matmul and quant2d;
* the call sites (vllm_kunlun/ops/_kunlun_ops.py on main: fused_moe :395-640 casts router logits
  to float32 and passes block_statistic=None to moe_softmax_topk_norm, fused_moe_ep :640-680
  passes torch.empty(0, int32) to moe_softmax_topk with scores in the logits' dtype; moe_fc's
  y is [M, topk, N] in sorted order, act="SWISH_GLU" writes the gated result into the first
  half of N (`y = y[..., : y.shape[-1] // 2]`, :577-606); the [12, E] block_statistic
  (`num_blocks = 12`); KunlunOps.rms_norm passes a float32 weight (:162));
* W8A8 (v0.11.0+): quant2d's scale "represents max" (ops/_custom_ops.py:1651), weight scales
  are multiplied by 127 (quantization/compressed_tensors/compressed_tensors_moe.py:117), and
  `_C.matmul(x_pc_max=, w_pc_max=)` replaces cutlass_scaled_mm(scale_a=x_s/127, scale_b=w_s/127)
  (quantization/kernels/scale_mm.py:83-100);
* the paged cache layout [blocks, heads, block_size, dim] of reshape_and_cache (vLLM's;
  kunlun_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) at
  ops/_kunlun_ops.py:244 @09869ee), kunlun_ops.silu_and_mul(x, axis=-1, turn=True, out=)
  (ops/_kunlun_ops.py:137);
* xspeedgate_ops.hadamard_transform as baidu-baige/sglang-kunlun calls it
  (sglang_kunlun/kernels/kernel_ops.py @cc7183ac).

Output buffers vLLM-Kunlun always zero-fills (block_statistic, expert_m, sorted_tokens_num_lod,
moe_index) are written only where the emulated kernel has something to write (rows of the
histogram for the chunks it has, counts of experts with rows, the lod after its first entry), so
an uninitialised buffer leaks into the result as it could on the XPU; every such buffer that
arrives non-zero is also named in `C.unzeroed_buffers`.

Where the public calls stop, the emulator stops too: other argument combinations, undefined
block_statistic tensors, expert counts above the 256 of the models vLLM-Kunlun's tutorials
serve, int8 paths before v0.11.0 raise `NotEmulatedError`. Violations of what the sources do
state raise `XpuOpError`. It never calls `glm5_hal.reference`; numerics are float32 like the
kernels' accumulators.
"""
from __future__ import annotations

import collections
import types
from typing import Sequence

import torch
from torch import Tensor

from glm5_hal.vendor_backend import leading_numbers

_F32, _F16, _BF16, _I8, _I32 = torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)
#: The most experts any public vLLM-Kunlun use runs the MoE kernels with (the 256 routed
#: experts of GLM-5 / DeepSeek-V3.2 in its tutorials); beyond it nothing is documented.
EMULATED_MAX_EXPERTS = 256
BLOCK_STATISTIC_ROWS = 12
HADAMARD_MAX_DIM = 32768
#: The vLLM-Kunlun versions emulated, and when `_C.matmul` / the W8A8 conventions appeared.
VLLM_KUNLUN_VERSIONS = ("0.10.1.1", "0.11.0", "0.15.1.dev0")
_W8A8_SINCE = (0, 11, 0)

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


def _experts_documented(op: str, experts: int) -> None:
    if experts > EMULATED_MAX_EXPERTS:
        raise NotEmulatedError(f"{op}: {experts} experts; no public source documents the kernels above "
                               f"{EMULATED_MAX_EXPERTS}")


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


def _write_histogram(into: Tensor, flat_ids: Tensor, experts: int) -> None:
    """The [12, experts] block_statistic: per-expert counts of up to 12 contiguous chunks of the
    ids, one row per chunk. Fewer ids than 12 full chunks leave the last rows as they were: the
    kernel writes the rows of the chunks it has, and every public caller zero-fills the buffer
    first (torch.zeros in fused_moe, vllm_kunlun/ops/_kunlun_ops.py:406 @09869ee, and
    compressed_tensors_moe.py:144), which is what makes the rows it skips read as zero."""
    chunk = max(1, -(-flat_ids.numel() // BLOCK_STATISTIC_ROWS))
    for row, part in enumerate(flat_ids.split(chunk)):
        into[row] = torch.bincount(part.long(), minlength=experts).to(_I32)


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
        """The keyword form KunlunOps.rms_norm uses: kunlun_ops.rmsnorm(x, weight.to(torch.float32),
        epsilon, out=out) (ops/_kunlun_ops.py:160 @ba13599/@e9f0322, :162 @09869ee). (The `_C.rmsnorm`
        wrapper passes (x, weight, output, eps) positionally with the model-dtype weight; that
        form is not emulated.)"""
        op = "kunlun_ops.rmsnorm"
        _tensor(op, "x", x, FLOATS)
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
    """torch.ops._C as one vLLM-Kunlun version registers it (keyword arguments, preallocated
    outputs). `fc_acts` records the act argument of every moe_fc call."""

    def __init__(self, calls: collections.Counter, prefix: str, version: str) -> None:
        super().__init__(calls, prefix)
        self.fc_acts: list = []
        #: "op.argument" for every buffer that every vLLM-Kunlun call site zero-fills
        #: (block_statistic / block_static, moe_index, expert_m, sorted_tokens_num_lod) but that
        #: arrived holding something else: what the closed kernel then reads is undefined
        self.unzeroed_buffers: list[str] = []
        self._w8a8 = leading_numbers(version)[:3] >= _W8A8_SINCE
        if self._w8a8:   # registered from v0.11.0 (vllm_utils_wrapper.py:2016 there)
            self.matmul = self._matmul

    def _note_unzeroed(self, op: str, **buffers: Tensor) -> None:
        for name, t in buffers.items():
            if isinstance(t, Tensor) and t.numel() and bool((t != 0).any()):
                self.unzeroed_buffers.append(f"{op}.{name}")

    def _route_outputs(self, op, x, first, second):
        _tensor(op, "x", x, FLOATS, ndim=2)
        _require(x.is_contiguous(), op, "x must be contiguous")
        tokens = x.shape[0]
        _tensor(op, "scores", first, FLOATS, ndim=2)
        _tensor(op, "topk_index", second, (_I32,), ndim=2, shape=first.shape)
        _require(first.shape[0] == tokens, op, "outputs need one row per token")
        _experts_documented(op, x.shape[1])
        return first.shape[1]

    def moe_softmax_topk_norm(self, x, normed_score, topk_index, block_statistic, stable=True):
        """As fused_moe calls it: float32 logits and scores, block_statistic=None."""
        op = "moe_softmax_topk_norm"
        if block_statistic is not None:
            raise NotEmulatedError(f"{op}: a block_statistic buffer (vLLM-Kunlun passes None here)")
        if x.dtype != _F32 or normed_score.dtype != _F32:
            raise NotEmulatedError(f"{op}: {x.dtype} logits / {normed_score.dtype} scores (vLLM-Kunlun casts the "
                                   "router logits to float32 first)")
        self._softmax_topk(op, x, normed_score, topk_index, True)

    def moe_softmax_topk(self, x, normed_score, topk_index, block_statistic, axis=-1, turn=True):
        """As fused_moe_ep calls it: scores in the logits' dtype, block_statistic an empty
        int32 tensor (the wrapper forwards (x, normed_score, topk_index, block_statistic) to
        kunlun_ops and drops axis / turn)."""
        op = "moe_softmax_topk"
        if block_statistic is None:
            raise NotEmulatedError(f"{op}: an undefined block_statistic (its schema type is a plain Tensor; "
                                   "vLLM-Kunlun passes torch.empty(0, dtype=torch.int32))")
        _tensor(op, "block_statistic", block_statistic, (_I32,))
        if block_statistic.numel():
            raise NotEmulatedError(f"{op}: a non-empty block_statistic (no public call passes one)")
        if normed_score.dtype != x.dtype:
            raise NotEmulatedError(f"{op}: {x.dtype} logits with {normed_score.dtype} scores (every public call "
                                   "passes the scores in the logits' dtype)")
        self._softmax_topk(op, x, normed_score, topk_index, False)

    def _softmax_topk(self, op, x, normed_score, topk_index, renormalise):
        topk = self._route_outputs(op, x, normed_score, topk_index)
        probs = torch.softmax(x.float(), dim=-1)
        values, ids = torch.topk(probs, topk, dim=-1)
        if renormalise:
            values = values / values.sum(dim=-1, keepdim=True)
        normed_score.copy_(values)
        topk_index.copy_(ids.to(_I32))

    def moe_sigmoid_group_topk_norm(self, x, topk_index, norm_score, block_static, bias, scale, n_group,
                                    topk_group):
        """As fused_moe calls it: float32 logits and scores, the [12, E] block_static, the
        e_score_correction_bias (selection only: the weights are the unbiased sigmoid scores,
        renormalised, times scale)."""
        op = "moe_sigmoid_group_topk_norm"
        if x.dtype != _F32 or norm_score.dtype != _F32:
            raise NotEmulatedError(f"{op}: {x.dtype} logits / {norm_score.dtype} scores (vLLM-Kunlun casts the "
                                   "router logits to float32 first)")
        if bias is None:
            raise NotEmulatedError(f"{op}: an undefined bias (its schema type is a plain Tensor; vLLM-Kunlun always "
                                   "passes e_score_correction_bias)")
        topk = self._route_outputs(op, x, norm_score, topk_index)
        experts = x.shape[1]
        _tensor(op, "block_static", block_static, (_I32,), shape=(BLOCK_STATISTIC_ROWS, experts))
        self._note_unzeroed(op, block_static=block_static)
        _tensor(op, "bias", bias, FLOATS, shape=(experts,))
        scores = torch.sigmoid(x.float())
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
        _write_histogram(block_static, ids.reshape(-1), experts)

    def gen_block_statistic(self, topk_ids, block_statistic):
        op = "gen_block_statistic"
        _tensor(op, "topk_ids", topk_ids, (_I32,), ndim=2)
        _tensor(op, "block_statistic", block_statistic, (_I32,), ndim=2)
        experts = block_statistic.shape[1]
        _experts_documented(op, experts)
        _require(block_statistic.shape[0] == BLOCK_STATISTIC_ROWS, op, f"block_statistic needs {BLOCK_STATISTIC_ROWS} rows")
        self._note_unzeroed(op, block_statistic=block_statistic)
        flat = topk_ids.reshape(-1)
        _require(flat.numel() == 0 or bool(((flat >= 0) & (flat < experts)).all()), op,
                 f"topk ids must lie in [0, {experts})")
        _write_histogram(block_statistic, flat, experts)

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
        _experts_documented(op, experts)
        flat = topk_index.reshape(-1).long()
        _require(bool(((flat >= 0) & (flat < experts)).all()), op, f"topk ids must lie in [0, {experts})")
        _tensor(op, "block_statistic", block_statistic, (_I32,), shape=(BLOCK_STATISTIC_ROWS, experts))
        _require(torch.equal(block_statistic.sum(dim=0), torch.bincount(flat, minlength=experts).to(_I32)), op,
                 "block_statistic is not the histogram of topk_index (stale gen_block_statistic?)")
        _tensor(op, "moe_expand", moe_expand, (x.dtype,), shape=(tokens * topk, x.shape[1]))
        _tensor(op, "moe_index", moe_index, (_I32,), shape=(tokens * topk,))
        _tensor(op, "sorted_tokens_num_lod", sorted_tokens_num_lod, (_I32,), shape=(experts + 1,))
        self._note_unzeroed(op, moe_index=moe_index, expert_m=expert_m, sorted_tokens_num_lod=sorted_tokens_num_lod)
        # the slots grouped by expert; the order inside an expert is not documented: stable here
        order = torch.argsort(flat, stable=True)
        slot_token = torch.arange(tokens).repeat_interleave(topk)
        moe_expand.copy_(x[slot_token[order]])
        moe_index.copy_(torch.argsort(order).to(_I32))
        counts = torch.bincount(flat, minlength=experts)
        # Written only where there is something to write: the count of an expert that has rows,
        # and the lod's running ends (lod[0] stays as found). vLLM-Kunlun zero-fills expert_m,
        # sorted_tokens_num_lod and moe_index before every call (torch.zeros,
        # ops/_kunlun_ops.py:534-548 @09869ee, compressed_tensors_moe.py:176-185 @09869ee, the same
        # at v0.10.1.1 and v0.11.0); what the closed kernel leaves unwritten is undocumented, and
        # this is the reading under which that zero-fill matters. moe_index gets every slot.
        used = counts > 0
        expert_m[used] = counts[used].to(_I32)
        sorted_tokens_num_lod[1:].copy_(counts.cumsum(0).to(_I32))

    def moe_fc(self, x, weight, sorted_tokens_num_lod, sorted_tokens_idx, moe_topk, y, act=None,
               x_perchannel_max=None, w_perchannel_max=None, topk_ids=None, topk_w=None, bias=None, tgemm_type=None,
               tweight_type=None, scale_n=0, scale_k=0, use_pack_int4=False, sort_mode=True):
        """Rows of x sorted by expert (lod: the prefix sum of rows per expert) times their
        expert's weight^T into y [tokens, moe_topk, N] (the same sorted order, viewed as vLLM-Kunlun
        allocates it). act="SWISH_GLU" writes silu(first half) * second half into the first
        N/2 columns (what is left in the rest is not documented: NaN here). With int8 x and
        weight (v0.11.0+), x_perchannel_max [rows, 1] and w_perchannel_max [E, N, 1] are
        per-row / per-channel maxima: the product is scaled by both / 127^2."""
        op = "moe_fc"
        self.fc_acts.append(act)
        if (topk_w is not None or bias is not None or tgemm_type is not None or tweight_type is not None
                or scale_n or scale_k or use_pack_int4 or not sort_mode):
            raise NotEmulatedError(f"{op}: topk_w / bias / tgemm_type / tweight_type / int4 / sort_mode=False")
        quantised = x_perchannel_max is not None or w_perchannel_max is not None
        _tensor(op, "x", x, (_I8,) if quantised else FLOATS, ndim=2)
        _tensor(op, "weight", weight, (x.dtype,), ndim=3)
        experts, n, k = weight.shape
        _experts_documented(op, experts)
        rows = x.shape[0]
        _require(x.shape[1] == k, op, f"x is [rows, {x.shape[1]}], weight is [experts, n, {k}]")
        _require(moe_topk >= 1 and rows % moe_topk == 0, op, f"rows {rows} are not tokens x moe_topk {moe_topk}")
        _tensor(op, "y", y, HALVES if quantised else (x.dtype,), shape=(rows // moe_topk, moe_topk, n))
        _tensor(op, "sorted_tokens_num_lod", sorted_tokens_num_lod, (_I32,), shape=(experts + 1,))
        lod = [int(v) for v in sorted_tokens_num_lod.tolist()]
        _require(lod[0] == 0 and all(b >= a for a, b in zip(lod, lod[1:])) and lod[-1] <= rows, op,
                 f"sorted_tokens_num_lod must be a prefix sum from 0 to at most {rows}, got {lod}")
        _tensor(op, "sorted_tokens_idx", sorted_tokens_idx, (_I32,), shape=(rows,))
        _require(bool(((sorted_tokens_idx >= 0) & (sorted_tokens_idx < rows)).all()), op,
                 "sorted_tokens_idx must index the rows")
        if quantised:
            if not self._w8a8:
                raise NotEmulatedError(f"{op}: the int8 path before vLLM-Kunlun 0.11.0 (no public W8A8 use)")
            if topk_ids is None:
                raise NotEmulatedError(f"{op}: the int8 path without topk_ids (vLLM-Kunlun always passes them)")
            _tensor(op, "topk_ids", topk_ids, (_I32,), shape=(rows // moe_topk, moe_topk))
            _tensor(op, "x_perchannel_max", x_perchannel_max, (_F32,), shape=(rows, 1))
            _tensor(op, "w_perchannel_max", w_perchannel_max, (_F32,), shape=(experts, n, 1))
            w = weight.double() * (w_perchannel_max.double() / 127.0)
            xs = x.double() * (x_perchannel_max.double() / 127.0)
        else:
            if topk_ids is not None:
                raise NotEmulatedError(f"{op}: topk_ids with unquantised weights (no public call passes them)")
            w, xs = weight.float(), x.float()
        out = torch.zeros(rows, n, dtype=w.dtype)
        for e in range(experts):
            out[lod[e]:lod[e + 1]] = xs[lod[e]:lod[e + 1]] @ w[e].T
        out = out.float().view(rows // moe_topk, moe_topk, n)
        if act is None:
            y.copy_(out.to(y.dtype))
        elif act == "SWISH_GLU" and isinstance(act, str):
            half = n // 2
            gate, up = out[..., :half], out[..., half:]
            y[..., :half] = (gate * torch.sigmoid(gate) * up).to(y.dtype)
            y[..., half:] = float("nan")
        else:
            raise XpuOpError(f"{op}: unknown act {act!r}")

    def _matmul(self, x, w, out_dtype, x_trans=False, w_trans=True, alpha=1.0, beta=0.0, bias=None, x_max=None,
                w_max=None, x_pc_max=None, w_pc_max=None):
        """_C.matmul as vLLM-Kunlun's W8A8 linear calls it (scale_mm.py:83-91): int8 x [M, K],
        w [N, K], per-token x_pc_max [M, 1] and per-channel w_pc_max [N, 1] maxima, an optional
        float32 bias [N]; out = (x @ w^T) * x_pc_max / 127 * w_pc_max^T / 127 + bias."""
        op = "matmul"
        if x_trans or not w_trans or alpha != 1.0 or beta != 0.0 or x_max is not None or w_max is not None:
            raise NotEmulatedError(f"{op}: transposes / alpha / beta / per-tensor maxima (not in the W8A8 call)")
        _tensor(op, "x", x, (_I8,), ndim=2)
        _tensor(op, "w", w, (_I8,), ndim=2)
        _require(x.shape[1] == w.shape[1], op, f"x [M, {x.shape[1]}] and w [N, {w.shape[1]}] disagree")
        if out_dtype not in HALVES:
            raise NotEmulatedError(f"{op}: out_dtype {out_dtype} (vLLM-Kunlun passes the activations' bf16/fp16)")
        _tensor(op, "x_pc_max", x_pc_max, (_F32,), shape=(x.shape[0], 1))
        _tensor(op, "w_pc_max", w_pc_max, (_F32,), shape=(w.shape[0], 1))
        out = (x.double() @ w.double().T) * (x_pc_max.double() / 127.0) * (w_pc_max.double().T / 127.0)
        if bias is not None:
            _tensor(op, "bias", bias, (_F32,), shape=(w.shape[0],))
            out = out + bias.double()
        return out.float().to(out_dtype)

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
    """torch.ops.xspeedgate_ops: hadamard_transform(x[, scale]) as baidu-baige/sglang-kunlun calls it
    in place of sglang's JIT Hadamard (sglang_kunlun/kernels/kernel_ops.py @cc7183ac), i.e.
    fast-hadamard-transform's Sylvester-order transform times scale. The power-of-two D and its
    32768 ceiling are that API's, UNVERIFIED for the Kunlun build."""

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
                 version: str = TORCH_XMLIR_VERSION, speedgate: bool = True,
                 vllm_kunlun: str | None = VLLM_KUNLUN_VERSIONS[-1]) -> None:
        self.device_name = CHIPS[chip]
        self.__version__ = version
        self.calls: collections.Counter = collections.Counter()
        self.cuda = _CudaModule(self.device_name, devices)
        self.torch = types.SimpleNamespace(__version__=torch_version,
                                           version=types.SimpleNamespace(cuda="11.8", hip=None), cuda=self.cuda)
        self.kunlun_ops = KunlunOps(self.calls, "kunlun_ops")
        self.C = OpsC(self.calls, "_C", vllm_kunlun or "0")
        self._packages = {"vllm-kunlun": vllm_kunlun} if vllm_kunlun else {}
        self.xspeedgate = SpeedgateOps(self.calls, "xspeedgate_ops") if speedgate else None
        self.xspeedgate_missing = "" if speedgate else "xspeedgate_ops not installed (emulated)"

    def current_stream(self, device: torch.device) -> int:
        return int(self.cuda.current_stream(device).cuda_stream)

    def package_version(self, name: str) -> str | None:
        return self._packages.get(name)


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

