"""HF transformers' `GlmMoeDsaRMSNorm` on glm5_hal's `rms_norm`."""
from __future__ import annotations

from torch import Tensor

from ... import ops as hal_ops

# Op calls go through this name so that `record_ops` can observe them (glm5_hal.models.trace).
ops = hal_ops


def rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    """`GlmMoeDsaRMSNorm.forward` as `rms_norm`. HF normalises in float32, casts back and
    multiplies by the weight: the same value when the weight has the input's dtype, the
    only case routed here."""
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def routable(self, hidden_states: Tensor) -> bool:
    return hidden_states.dtype == self.weight.dtype
