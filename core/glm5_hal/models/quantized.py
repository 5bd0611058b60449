"""Linear layers and routed experts on quantized weights (docs/ops/quant.md, the checkpoint formats), as
`GLM5ForCausalLM.from_pretrained` builds them:

- FP8, the DeepSeek-V3 / GLM-5-FP8 checkpoint format: `weight` float8_e4m3fn [N, K] and
  `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)], one scale per 128 x 128 block, which
  multiplies. Activations are quantized per token and 128 columns (`fp8_block_quant`), the
  GEMMs are `fp8_block_gemm` / `fp8_grouped_gemm`.
- INT8 W8A8, converted at load: `weight` int8 [N, K] with one float32 scale per output channel
  (`weight_scale` [N], from `int8_quant` of the weight rows); activations per token
  (`int8_quant`), GEMMs `int8_gemm` / `int8_grouped_gemm`.

The quantized tensors keep their dtype when the model moves or changes dtype (`model.to(...)`
casts only the float parameters), and follow it to another device.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import ops as hal_ops
from ..reference.quant import FP8_GEMM_BLOCK, fp8_block_dequantize
from .config import GLM5Config
from .layers import register_checkpoint_layout

# Op calls go through this name so that `trace.record_ops()` observes them (as in layers.py).
ops = hal_ops

FP8 = torch.float8_e4m3fn
#: The FP8 block: weights in 128 x 128 blocks, activations in 1 x 128 blocks (docs/ops/quant.md).
FP8_BLOCK = FP8_GEMM_BLOCK


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _FixedDtypes(nn.Module):
    """Buffers named in FIXED_DTYPES keep their dtype through `_apply` (`.to(dtype)`, `.half()`,
    ...): float8 is a floating-point dtype to torch, so `model.to(torch.bfloat16)` would
    otherwise convert the FP8 weights, and the float32 scales must stay float32. Device moves
    (`.to(device)`, `to_empty`) still apply."""
    FIXED_DTYPES: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        order = list(self._buffers)
        fixed = {name: self._buffers.pop(name) for name in self.FIXED_DTYPES if name in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, tensor in fixed.items():
                device = fn(tensor.new_empty(0)).device   # where fn sends a tensor, without converting one
                if tensor.device != device:
                    tensor = (torch.empty(tensor.shape, dtype=tensor.dtype, device=device) if tensor.is_meta
                              else tensor.to(device))
                fixed[name] = tensor
            rest = dict(self._buffers)
            self._buffers.clear()
            self._buffers.update({name: fixed[name] if name in fixed else rest[name] for name in order})
        return self


class Fp8Linear(_FixedDtypes):
    """A linear layer of an FP8 checkpoint (no bias): `weight` float8_e4m3fn [N, K],
    `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)]. forward(x [..., K]) quantizes x per
    token and 128 columns (`scale_fmt` None or "ue8m0", the checkpoint's `scale_fmt`) and runs
    `fp8_block_gemm` into x's dtype; K must be a multiple of 128.

    `dense=True` (kv_b_proj, whose weight MLA absorption multiplies as a matrix) also keeps the
    dequantized weight as the non-persistent buffer `dense_weight` in the model dtype, filled by
    `after_load()`, as serving engines do for MLA absorption."""
    FIXED_DTYPES = ("weight", "weight_scale_inv")
    FORMAT = "fp8"

    def __init__(self, in_features: int, out_features: int, scale_fmt: str | None = None, dense: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.scale_fmt = in_features, out_features, scale_fmt
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale_inv", torch.empty(
            ceil_div(out_features, FP8_BLOCK), ceil_div(in_features, FP8_BLOCK), dtype=torch.float32))
        if dense:
            self.register_buffer("dense_weight", torch.empty(out_features, in_features), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        a, a_scale = ops.fp8_block_quant(x.reshape(-1, self.in_features), FP8_BLOCK, self.scale_fmt)
        out = ops.fp8_block_gemm(a, a_scale, self.weight, self.weight_scale_inv, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def after_load(self) -> None:
        dense = getattr(self, "dense_weight", None)
        if dense is not None:
            dense.copy_(fp8_block_dequantize(self.weight, self.weight_scale_inv))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks" + (
            f", activation scales {self.scale_fmt}" if self.scale_fmt else "")


class Int8Linear(_FixedDtypes):
    """A W8A8 linear layer (no bias): `weight` int8 [N, K], `weight_scale` float32 [N] (one
    per output channel). forward(x [..., K]) quantizes x per token (`int8_quant`) and runs
    `int8_gemm` into x's dtype."""
    FIXED_DTYPES = ("weight", "weight_scale")
    FORMAT = "int8"

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        q, scale = ops.int8_quant(x.reshape(-1, self.in_features))
        out = ops.int8_gemm(q, scale, self.weight, self.weight_scale, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel scales"


class Fp8Experts(_FixedDtypes):
    """`mlp.experts` of an FP8 checkpoint, stacked like `layers.Experts`: `gate_up_proj`
    float8_e4m3fn [E, 2I, H] with `gate_up_proj_scale_inv` [E, 2I/128, H/128], `down_proj`
    [E, H, I] with `down_proj_scale_inv` [E, H/128, I/128] (I and H multiples of 128, so that no
    scale block straddles an expert's gate and up rows). Each GEMM's input is quantized per
    token and 128 columns, then `fp8_grouped_gemm`."""
    FIXED_DTYPES = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    CHECKPOINT_SUFFIXES = {"weight": "", "weight_scale_inv": "_scale_inv"}
    FORMAT = "fp8"

    def __init__(self, config: GLM5Config, scale_fmt: str | None = None):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size, self.scale_fmt = e, i, scale_fmt
        for name, (n, k) in {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}.items():
            self.register_buffer(name, torch.empty(e, n, k, dtype=FP8))
            self.register_buffer(name + "_scale_inv", torch.empty(
                e, ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK), dtype=torch.float32))
        register_checkpoint_layout(self)

    def forward(self, rows: Tensor, tokens_per_expert: Tensor) -> Tensor:
        a, a_scale = ops.fp8_block_quant(rows, FP8_BLOCK, self.scale_fmt)
        gate_up = ops.fp8_grouped_gemm(a, a_scale, self.gate_up_proj, self.gate_up_proj_scale_inv,
                                       tokens_per_expert, rows.dtype)
        a, a_scale = ops.fp8_block_quant(ops.silu_and_mul(gate_up), FP8_BLOCK, self.scale_fmt)
        return ops.fp8_grouped_gemm(a, a_scale, self.down_proj, self.down_proj_scale_inv, tokens_per_expert,
                                    rows.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}, fp8 e4m3 128x128 blocks"
                + (f", activation scales {self.scale_fmt}" if self.scale_fmt else ""))


class Int8Experts(_FixedDtypes):
    """`mlp.experts` in W8A8: `gate_up_proj` int8 [E, 2I, H] with `gate_up_proj_scale` [E, 2I],
    `down_proj` int8 [E, H, I] with `down_proj_scale` [E, H] (one scale per output channel of
    each expert). Each GEMM's input is quantized per token, then `int8_grouped_gemm`."""
    FIXED_DTYPES = ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale")
    CHECKPOINT_SUFFIXES = {"weight": "", "weight_scale": "_scale"}
    FORMAT = "int8"

    def __init__(self, config: GLM5Config):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size = e, i
        for name, (n, k) in {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}.items():
            self.register_buffer(name, torch.empty(e, n, k, dtype=torch.int8))
            self.register_buffer(name + "_scale", torch.empty(e, n, dtype=torch.float32))
        register_checkpoint_layout(self)

    def forward(self, rows: Tensor, tokens_per_expert: Tensor) -> Tensor:
        q, scale = ops.int8_quant(rows)
        gate_up = ops.int8_grouped_gemm(q, scale, self.gate_up_proj, self.gate_up_proj_scale, tokens_per_expert,
                                        rows.dtype)
        q, scale = ops.int8_quant(ops.silu_and_mul(gate_up))
        return ops.int8_grouped_gemm(q, scale, self.down_proj, self.down_proj_scale, tokens_per_expert, rows.dtype)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}, int8 per-channel scales"


@torch.no_grad()
def write_weight(dest_format: str, dest: dict[str, Tensor], weight: Tensor, scale: Tensor | None) -> None:
    """Writes one checkpoint linear weight (float, or FP8 with its 128 x 128 block scales) into
    a model's tensors in `dest_format`: "float" ({"weight": view}, dequantized if FP8), "fp8"
    ({"weight", "weight_scale_inv"}, copied; the source must be FP8) or "int8" ({"weight",
    "weight_scale"}, quantized per output channel with `int8_quant`)."""
    if dest_format == "fp8":
        dest["weight"].copy_(weight)
        dest["weight_scale_inv"].copy_(scale)
        return
    dense = weight if scale is None else fp8_block_dequantize(weight, scale)
    if dest_format == "float":
        dest["weight"].copy_(dense)
    else:
        q, channel_scale = ops.int8_quant(dense if dense.dtype in (torch.bfloat16, torch.float16) else dense.float())
        dest["weight"].copy_(q)
        dest["weight_scale"].copy_(channel_scale)


__all__ = ["Fp8Linear", "Int8Linear", "Fp8Experts", "Int8Experts", "FP8_BLOCK", "write_weight"]
