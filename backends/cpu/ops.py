"""Python wrappers of the native kernels: inputs are already validated by glm5_hal.ops;
these make layouts kernel-ready, allocate outputs with torch and pass data pointers."""
from __future__ import annotations

import torch

from . import cpu

try:
    from glm5_hal import _C
except ImportError:  # the probe reports it; these kernels are then never chosen
    _C = None

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
# glm5::DType codes (csrc/core.h)
DTYPE_CODE = {_F32: 0, _F16: 1, _BF16: 2, torch.float8_e4m3fn: 3, torch.int32: 4, torch.int64: 5}
FLOATS = (_F32, _F16, _BF16)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last] with a unit stride along the last dim (copies only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


@cpu.impl("rms_norm", dtypes=FLOATS)
def rms_norm(x, weight, eps):
    x2 = rows_view(x)
    w = weight.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype)
    _C.rms_norm(out.data_ptr(), x2.data_ptr(), w.data_ptr(), x2.shape[0], x2.shape[1],
                x2.stride(0), out.stride(0), float(eps), DTYPE_CODE[x.dtype],
                DTYPE_CODE[w.dtype], torch.get_num_threads())
    return out.view(x.shape)
