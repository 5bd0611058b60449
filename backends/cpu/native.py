"""What the cpu backend's op families share around the native kernels of glm5_hal._C: the
extension itself, the dtypes the kernels take and the thread count. Tensors go to the kernels
as they are: _C reads their sizes, strides and dtypes, and copies an input whose layout a
kernel cannot read in place (csrc/view.h), so no wrapper restates either."""
from __future__ import annotations

import torch

try:
    from glm5_hal import _C
except ImportError:  # the probe reports it; these kernels are then never chosen
    _C = None

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn
threads = torch.get_num_threads
