"""A CPU emulator of the Enflame GCU surface glm5_hal's enflame adapters call (the surface
backends/enflame/runtime.py describes): what torch_gcu adds to torch (`torch.gcu` with its
device queries, the `gcu` PrivateUse1 device) and the ops vllm-gcu's extension `vllm_gcu._C`
registers for PrivateUse1 under vLLM's op namespaces (`torch.ops._C`, `torch.ops._C_cache_ops`).

Written from EnflameTechnology/vllm-gcu @7b5aaca9 and the vLLM kernels whose schemas it
registers, never from glm5_hal.reference:
* vllm_gcu/gcu.py: device_type "gcu", dispatch_key "PrivateUse1", TOPS_VISIBLE_DEVICES;
  get_device_capability() is torch.gcu.get_device_capability() with 10 added to the major
  (line 108-109), supports_fp8() from 14.0 (line 392-397), and capability 13.0 turns an fp8
  KV cache into int8 (line 259-261): torch.gcu (3, x) is the gcu300 generation, (4, x) gcu400;
* csrc/torch_bindings.cpp: the schemas (rms_norm(Tensor! result, Tensor input, Tensor weight,
  float epsilon), silu_and_mul(Tensor! result, Tensor input), rotary_embedding(Tensor
  positions, Tensor! query, Tensor! key, int head_size, Tensor cos_sin_cache, bool is_neox),
  dynamic_scaled_int8_quant(Tensor! output, Tensor input, Tensor! scales, Tensor azp),
  _C_cache_ops.concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, Tensor
  slot_mapping, str kv_cache_dtype, Tensor scale), linear_quant(Tensor! out, Tensor lhs, Tensor
  rhs, Tensor? bias, Tensor lhs_scale, Tensor rhs_scale), fused_grouped_topk(Tensor! topk_weights,
  Tensor! topk_ids, Tensor gating_output, int topk, bool renormalize, int num_expert_group, int
  topk_group, Tensor e_score_correction_bias, str scoring_func));
* vllm_gcu/kernels/fused_moe.py:234-268: fused_grouped_topk replaces vLLM's grouped_topk (same
  arguments, float32 weights, int32 ids), so its semantics are those of vLLM's grouped_topk of that
  signature (vllm-project/vllm vllm/model_executor/layers/fused_moe/fused_moe.py @000d1458):
  scores = softmax or sigmoid of the gating output in its own dtype; with a correction bias a
  group's score is the sum of its best two biased scores (topk(2): a group of one expert is an
  error), the topk_group best groups are kept (others -inf), the top-k biased scores pick the
  ids (sorted=False), the weights are the unbiased scores of those ids, divided by their plain
  sum when renormalize;
* vllm_gcu/kernels/_custom_ops.py:564-579: linear_quant is what vllm-gcu's w8a8_block_fp8_matmul(A,
  B, As, Bs, block_size, output_dtype=float16) calls, so its layout is that function's in vLLM
  0.9.2 (vllm/model_executor/layers/quantization/utils/fp8_utils.py): A [M, K] and B [N, K] fp8,
  As [M, K / 128] per token and 128 columns, Bs [ceil(N / 128), K / 128] per 128 x 128 block, an
  fp16/bf16 output; _w8a8_block_fp8_matmul accumulates in float32 block by block, each block's
  products times its two scales (`accumulator += tl.dot(a, b) * a_s[:, None] * b_s[None, :]`);
* csrc/src/rms_norm.cpp, silu_and_mul.cpp, rotary_embedding.cpp: inputs viewed as
  [-1, size(-1)], an empty input returns at once; the kernels themselves are topsvllm's
  (closed): their numerics follow the vLLM kernels of the same schema --
  vllm-project/vllm csrc/layernorm_kernels.cu (float32 sum of squares, weight in the input's
  type), csrc/activation_kernels.cu, csrc/pos_encoding_kernels.cu @0f5257e2 (cos_sin_cache
  row = cosines then sines, in the query's dtype; NeoX pairs (i, i + rot/2), GPT-J (2i, 2i+1)),
  csrc/quantization/compressed_tensors/int8_quant_kernels.cu (scale = absmax / 127, codes =
  round-to-nearest-even(x * 127 / absmax) clamped to [-128, 127]), csrc/cache_kernels.cu
  (concat_and_cache_mla: slot < 0 skipped, row = kv_c then k_pe, "auto" stores the input type).

What the sources leave open raises NotEmulatedError (e.g. float64); a violated documented
constraint raises GcuOpError (a RuntimeError, as TORCH_CHECK / ATEN_ATENOP_CHECK do). A row
of zeros in dynamic_scaled_int8_quant divides by a zero scale in vLLM's kernel (its codes are
not specified): the emulator writes -128 there, so an adapter relying on them fails.
"""
from __future__ import annotations

import collections
import types

import torch
from torch import Tensor

from . import vllm_kernels

FLOATS = (torch.float32, torch.float16, torch.bfloat16)

#: chip -> (torch.gcu.get_device_name, torch.gcu.get_device_capability)
CHIPS = {
    "gcu300": ("Enflame S60", (3, 0)),
    "gcu400": ("Enflame gcu400", (4, 0)),
    "gcu200": ("Enflame T20", (2, 0)),
}


class GcuOpError(RuntimeError):
    """What a TORCH_CHECK / ATEN_ATENOP_CHECK in vllm-gcu's ops raises."""


class NotEmulatedError(RuntimeError):
    """Vendor behaviour the sources do not document."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise GcuOpError(f"{op}: {message}")


def _float_only(op: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype not in FLOATS:
            raise NotEmulatedError(f"{op}: vLLM's kernel of this schema dispatches float32/float16/bfloat16, "
                                   f"got {t.dtype}")


class _Gcu:
    """torch.gcu as torch_gcu sets it."""

    def __init__(self, emulator: "GcuEmulator") -> None:
        self._emulator = emulator

    def is_available(self) -> bool:
        return self._emulator.devices > 0

    def device_count(self) -> int:
        return self._emulator.devices

    def current_device(self) -> int:
        if self._emulator.devices == 0:
            raise RuntimeError("No GCU devices are available")
        return 0

    def get_device_name(self, device: object = None) -> str:
        return CHIPS[self._emulator.chip][0]

    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        return CHIPS[self._emulator.chip][1]


class _COps:
    """torch.ops._C as vllm_gcu._C registers it for PrivateUse1."""

    def __init__(self, emulator: "GcuEmulator") -> None:
        self._emulator = emulator

    def rms_norm(self, result: Tensor, input: Tensor, weight: Tensor, epsilon: float) -> None:
        op = "torch.ops._C.rms_norm"
        self._emulator.calls["rms_norm"] += 1
        if input.numel() == 0:
            return
        _float_only(op, input)
        _require(weight.dtype == input.dtype and weight.shape == (input.shape[-1],), op,
                 f"weight must be [{input.shape[-1]}] {input.dtype}, got {list(weight.shape)} {weight.dtype}")
        _require(result.shape == input.shape and result.dtype == input.dtype and result.is_contiguous()
                 and input.is_contiguous(), op, "result and input must be contiguous, same shape and dtype")
        rows = input.view(-1, input.shape[-1]).float()
        normed = rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + float(epsilon))
        # vLLM's kernel rounds x * rsqrt to the input type before the weight multiply
        result.view(-1, input.shape[-1]).copy_(normed.to(input.dtype) * weight)

    def silu_and_mul(self, result: Tensor, input: Tensor) -> None:
        op = "torch.ops._C.silu_and_mul"
        self._emulator.calls["silu_and_mul"] += 1
        if input.numel() == 0:
            return
        _float_only(op, input)
        half = input.shape[-1] // 2
        _require(input.shape[-1] % 2 == 0 and input.is_contiguous(), op, "input must be contiguous, even last dim")
        _require(result.shape == (*input.shape[:-1], half) and result.dtype == input.dtype, op,
                 f"result must be {[*input.shape[:-1], half]} {input.dtype}")
        gate, up = input[..., :half].float(), input[..., half:].float()
        # vLLM's act_and_mul_kernel: silu in float32 rounded to the type, then times up
        result.copy_(((gate * torch.sigmoid(gate)).to(input.dtype).float() * up).to(input.dtype))

    def rotary_embedding(self, positions: Tensor, query: Tensor, key: Tensor, head_size: int,
                         cos_sin_cache: Tensor, is_neox: bool) -> None:
        op = "torch.ops._C.rotary_embedding"
        self._emulator.calls["rotary_embedding"] += 1
        if query.numel() == 0:
            return
        _float_only(op, query)
        _require(key is not None, op, "key is a Tensor! argument (vllm-gcu views it as [-1, size(-1)])")
        vllm_kernels.rotary_embedding(_require, op, positions, query, key, head_size, cos_sin_cache, is_neox)

    def dynamic_scaled_int8_quant(self, output: Tensor, input: Tensor, scales: Tensor, azp: Tensor | None) -> None:
        op = "torch.ops._C.dynamic_scaled_int8_quant"
        self._emulator.calls["dynamic_scaled_int8_quant"] += 1
        _float_only(op, input)
        if azp is not None:
            raise NotEmulatedError(f"{op}: the asymmetric (azp) path is not emulated")
        hidden = input.shape[-1]
        tokens = input.numel() // max(hidden, 1)
        _require(input.is_contiguous() and output.is_contiguous(), op, "input and output must be contiguous")
        _require(output.dtype == torch.int8 and output.shape == input.shape, op, "output must be int8 like input")
        _require(scales.dtype == torch.float32 and scales.numel() == tokens, op,
                 f"scales must be float32 [{tokens}, 1]")
        codes, scale = vllm_kernels.dynamic_int8(input.reshape(tokens, hidden))  # a zero row: -128 codes
        output.view(tokens, hidden).copy_(codes)
        scales.view(tokens, 1).copy_(scale)

    def fused_grouped_topk(self, topk_weights: Tensor, topk_ids: Tensor, gating_output: Tensor, topk: int,
                           renormalize: bool, num_expert_group: int, topk_group: int,
                           e_score_correction_bias: Tensor, scoring_func: str) -> None:
        op = "torch.ops._C.fused_grouped_topk"
        self._emulator.calls["fused_grouped_topk"] += 1
        tokens, experts = gating_output.shape
        _require(topk_weights.dtype == torch.float32 and tuple(topk_weights.shape) == (tokens, topk), op,
                 f"topk_weights must be float32 [{tokens}, {topk}]")
        _require(topk_ids.dtype == torch.int32 and tuple(topk_ids.shape) == (tokens, topk), op,
                 f"topk_ids must be int32 [{tokens}, {topk}]")
        _require(e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) == (experts,), op,
                 f"e_score_correction_bias is a Tensor [{experts}] (not optional in the schema)")
        _require(experts % num_expert_group == 0, op, "num_expert_group must divide the experts")
        if scoring_func == "softmax":
            scores = torch.softmax(gating_output, dim=-1)
        elif scoring_func == "sigmoid":
            scores = gating_output.sigmoid()
        else:
            raise GcuOpError(f"{op}: Unsupported scoring function: {scoring_func}")
        per_group = experts // num_expert_group
        _require(per_group >= 2, op, "a group's score is topk(2) of its experts: groups need two")
        original = scores
        scores = scores + e_score_correction_bias.unsqueeze(0)
        group_scores = scores.view(tokens, num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(tokens, num_expert_group, per_group).reshape(tokens, -1)
        masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(masked, k=topk, dim=-1, sorted=False)[1]
        weights = original.gather(1, ids)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        topk_weights.copy_(weights.to(torch.float32))
        topk_ids.copy_(ids.to(torch.int32))

    def linear_quant(self, out: Tensor, lhs: Tensor, rhs: Tensor, bias: Tensor | None, lhs_scale: Tensor,
                     rhs_scale: Tensor) -> None:
        op = "torch.ops._C.linear_quant"
        self._emulator.calls["linear_quant"] += 1
        if lhs.numel() == 0:   # linear_quant.cpp returns at once
            return
        fp8 = torch.float8_e4m3fn
        if lhs.dtype != fp8 or rhs.dtype != fp8:
            raise NotEmulatedError(f"{op}: only the FP8 block path (w8a8_block_fp8_matmul) is emulated")
        if out.dtype not in (torch.float16, torch.bfloat16):
            raise NotEmulatedError(f"{op}: w8a8_block_fp8_matmul writes fp16/bf16, got {out.dtype}")
        if bias is not None:
            raise NotEmulatedError(f"{op}: the bias path is not emulated")
        block = 128
        rows, inner = lhs.shape
        cols = rhs.shape[0]
        _require(rhs.dim() == 2 and rhs.shape[1] == inner and inner % block == 0, op,
                 f"lhs [M, K], rhs [N, K] with K a multiple of {block}")
        _require(lhs_scale.dtype == rhs_scale.dtype == torch.float32, op, "scales must be float32")
        _require(tuple(lhs_scale.shape) == (rows, inner // block), op, f"lhs_scale must be [{rows}, {inner // block}]")
        _require(tuple(rhs_scale.shape) == (-(-cols // block), inner // block), op,
                 f"rhs_scale must be [{-(-cols // block)}, {inner // block}]")
        _require(tuple(out.shape) == (rows, cols) and out.is_contiguous(), op, f"out must be [{rows}, {cols}]")
        _require(lhs.is_contiguous() and rhs.is_contiguous(), op, "lhs and rhs must be contiguous (K-major)")
        acc = torch.zeros(rows, cols, dtype=torch.float32)
        column_scale = rhs_scale.repeat_interleave(block, dim=0)[:cols]
        for k in range(inner // block):
            part = lhs[:, k * block:(k + 1) * block].float() @ rhs[:, k * block:(k + 1) * block].float().T
            acc += part * lhs_scale[:, k:k + 1] * column_scale[None, :, k]
        out.copy_(acc)


class _CacheOps:
    """torch.ops._C_cache_ops as vllm_gcu._C registers it."""

    def __init__(self, emulator: "GcuEmulator") -> None:
        self._emulator = emulator

    def concat_and_cache_mla(self, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                             kv_cache_dtype: str, scale: Tensor) -> None:
        op = "torch.ops._C_cache_ops.concat_and_cache_mla"
        self._emulator.calls["concat_and_cache_mla"] += 1
        if kv_cache_dtype != "auto":
            raise NotEmulatedError(f"{op}: only kv_cache_dtype 'auto' is emulated, got {kv_cache_dtype!r}")
        tokens = slot_mapping.numel()
        _require(slot_mapping.dtype == torch.int64 and slot_mapping.dim() == 1, op, "slot_mapping must be int64 [T]")
        _require(kv_c.dim() == 2 and k_pe.dim() == 2 and kv_c.shape[0] == k_pe.shape[0] == tokens, op,
                 "kv_c [T, kv_lora_rank] and k_pe [T, pe_dim] must have one row per slot")
        _require(kv_cache.dim() == 3 and kv_cache.shape[2] == kv_c.shape[1] + k_pe.shape[1], op,
                 "kv_cache must be [num_blocks, block_size, kv_lora_rank + pe_dim]")
        _require(kv_c.dtype == k_pe.dtype == kv_cache.dtype, op, "'auto' stores the input type: dtypes must agree")
        _require(kv_cache.is_contiguous(), op, "kv_cache must be contiguous")
        capacity = kv_cache.shape[0] * kv_cache.shape[1]
        _require(bool((slot_mapping < capacity).all()), op, "a slot beyond the cache would be written out of bounds")
        rows = kv_cache.view(capacity, -1)
        rank = kv_c.shape[1]
        for t in range(tokens):
            slot = int(slot_mapping[t])
            if slot < 0:  # padded token
                continue
            rows[slot, :rank] = kv_c[t]
            rows[slot, rank:] = k_pe[t]


class GcuEmulator:
    """Stands in for GcuRuntime. `chip` is a key of CHIPS; `version` the torch_gcu version;
    `vllm_gcu` (a version, or None: not installed) whether vllm-gcu's ops are registered;
    `gcu_attribute` False poses as a torch_gcu that did not set torch.gcu. `calls` counts
    vendor calls."""

    EMULATOR = True

    def __init__(self, chip: str = "gcu400", *, devices: int = 8, version: str = "2.7.0+3.5.0",
                 vllm_gcu: str | None = "0.9.2+3.6", gcu_attribute: bool = True) -> None:
        if chip not in CHIPS:
            raise ValueError(f"unknown chip {chip!r}; emulated: {', '.join(CHIPS)}")
        self.chip, self.devices = chip, devices
        self.calls: collections.Counter = collections.Counter()
        self.__version__ = version
        self.gcu = _Gcu(self) if gcu_attribute else None
        self.ops = types.SimpleNamespace(_C=_COps(self), _C_cache_ops=_CacheOps(self)) if vllm_gcu else None
        self.ops_missing = "" if vllm_gcu else "vllm_gcu not installed (vllm-gcu's ops: EnflameTechnology/vllm-gcu)"
        self._packages = {"vllm_gcu": vllm_gcu} if vllm_gcu else {}

    def package_version(self, name: str) -> str | None:
        return self._packages.get(name)

    def __repr__(self) -> str:
        return f"GcuEmulator(chip={self.chip!r})"
