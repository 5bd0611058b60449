"""Adapters from glm5_hal's canonical ops to torch_npu's fused ops.

`declare(backend)` registers one closure per op on an AscendBackend instance; each reaches
the vendor through `backend.runtime` (the real `torch_npu`, or an emulator in tests), so
several instances coexist. Inputs arrive validated by glm5_hal.ops; an adapter converts
layouts and index conventions, calls the vendor op and returns exactly the canonical
outputs. Each `supports()` checks the vendor's documented per-call constraints and returns
a reason when the call falls outside them, so dispatch moves on instead of the vendor op
failing on the device. README.md has the table of what maps to what.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from . import AscendBackend

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
FLOATS = (_F32, _F16, _BF16)
HALVES = (_F16, _BF16)

#: The vendor constraints the adapters check, as reported in capabilities().limits.
OP_LIMITS = {
    "npu_rms_norm": "x 2-8 dims (adapter flattens to [rows, D]); gamma in x's dtype",
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def declare(backend: "AscendBackend") -> None:
    """Declares every adapter on `backend`."""
    _declare_common(backend)


# -- common ------------------------------------------------------------------------------------
def _declare_common(backend: "AscendBackend") -> None:
    def rms_norm_supported(x: Tensor, weight: Tensor, eps: float):
        if weight.dtype == x.dtype or x.dtype == _F32:
            return True
        return (f"npu_rms_norm takes gamma in x's dtype; casting the {_name(weight.dtype)} weight to "
                f"{_name(x.dtype)} would round it")

    @backend.impl("rms_norm", dtypes=FLOATS, supports=rms_norm_supported)
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.numel() == 0:
            return torch.empty_like(x)
        # npu_rms_norm wants 2-8 dims and normalises over gamma's dims: [rows, D] covers all.
        rows = x.reshape(-1, x.shape[-1])
        y, _rstd = backend.runtime.npu_rms_norm(rows, weight.to(x.dtype), epsilon=float(eps))
        return y.view(x.shape)
