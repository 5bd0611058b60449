"""HF transformers' routed experts (`experts_implementation="glm5_hal"`) on glm5_hal ops.

HF's router has already chosen `top_k_index` and `top_k_weights`; the experts run as the
MoE composition of docs/ops/moe.md: `moe_permute -> grouped_gemm(gate_up_proj) ->
silu_and_mul -> grouped_gemm(down_proj) -> moe_unpermute`. HF keeps the experts stacked as
`gate_up_proj [E, 2I, H]` (gate rows, then up rows) and `down_proj [E, H, I]`, which is
grouped_gemm's layout. FP8 experts (transformers' `FP8Experts`, DeepSeek-V3-style 128 x 128
block scales that multiply) quantize their activations per token and 128 columns with
`fp8_block_quant` and run `fp8_grouped_gemm`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import ops as hal_ops
from ...errors import InvalidInputError

# Op calls go through this name so that `record_ops` can observe them (glm5_hal.models.trace).
ops = hal_ops

_OP = "glm5_hal experts"
FP8_BLOCK = 128


def experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """`GlmMoeDsaExperts.forward` (any `use_experts_implementation` experts module with a
    fused SwiGLU gate_up_proj) on glm5_hal ops: hidden [T, H], top_k_index [T, k] (expert
    ids; ids outside [0, E), e.g. another expert-parallel rank's, are dropped),
    top_k_weights [T, k] -> [T, H]."""
    _check_layout(self)
    rows, tokens_per_expert, src = ops.moe_permute(hidden_states, top_k_index.to(torch.int32), self.num_experts)
    hidden = ops.silu_and_mul(ops.grouped_gemm(rows, self.gate_up_proj, tokens_per_expert))
    out = ops.grouped_gemm(hidden, self.down_proj, tokens_per_expert)
    return ops.moe_unpermute(out, src, top_k_weights.float())


def fp8_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' `FP8Experts.forward` on glm5_hal ops: FP8 e4m3 weights with float32
    block scales of 128 x 128 and dynamic activation quantization (the GLM-5 / DeepSeek-V3
    FP8 checkpoint format, docs/ops/quant.md)."""
    _check_layout(self)
    if (list(self.block_size or ()) != [FP8_BLOCK, FP8_BLOCK] or self.activation_scheme != "dynamic"
            or self.gate_up_proj.dtype != torch.float8_e4m3fn or self.gate_up_proj_scale_inv.dtype != torch.float32):
        raise InvalidInputError(_OP, "experts", "FP8 e4m3 experts with float32 128 x 128 block scales and "
                                "dynamic activation scales", f"{self.gate_up_proj.dtype} weights, "
                                f"{self.gate_up_proj_scale_inv.dtype} scales, block {self.block_size}, "
                                f"{self.activation_scheme} activations")
    out_dtype = hidden_states.dtype
    rows, tokens_per_expert, src = ops.moe_permute(hidden_states, top_k_index.to(torch.int32), self.num_experts)
    a, a_scale = ops.fp8_block_quant(rows, FP8_BLOCK)
    gate_up = ops.fp8_grouped_gemm(a, a_scale, self.gate_up_proj, self.gate_up_proj_scale_inv,
                                   tokens_per_expert, out_dtype)
    a, a_scale = ops.fp8_block_quant(ops.silu_and_mul(gate_up), FP8_BLOCK)
    out = ops.fp8_grouped_gemm(a, a_scale, self.down_proj, self.down_proj_scale_inv, tokens_per_expert, out_dtype)
    return ops.moe_unpermute(out, src, top_k_weights.float())


def _check_layout(self) -> None:
    """The experts' layout and activation are the ones these ops compute."""
    problems = [name for name, ok in (
        ("a fused gate_up_proj (has_gate)", getattr(self, "has_gate", True)),
        ("no biases", not getattr(self, "has_bias", False)),
        ("[E, N, K] weights (not is_transposed)", not getattr(self, "is_transposed", False)),
        ("gate rows then up rows (is_concatenated)", getattr(self, "is_concatenated", True)),
        ("no post-expert norm", not getattr(self, "has_post_expert_norm", False)),
        ("the silu activation", getattr(self.config, "hidden_act", "silu") in ("silu", "swish")),
        ("no clamped or soft-capped SwiGLU", all(getattr(self, a, None) is None for a in (
            "swiglu_limit", "swiglu_alpha", "limit", "gate_softcap", "up_softcap")))) if not ok]
    if problems:
        raise InvalidInputError(_OP, "experts", "SwiGLU experts with " + ", ".join(problems),
                                type(self).__name__)

