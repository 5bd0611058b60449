"""What the cpu backend's op families share around the native kernels of glm5_hal._C: the
extension itself, the element types it takes, the thread count, and the layout helpers that
make a tensor addressable by a kernel in place (copying only what a kernel cannot address).
Kept lean: every line here is paid on every call."""
from __future__ import annotations

import torch

try:
    from glm5_hal import _C
except ImportError:  # the probe reports it; these kernels are then never chosen
    _C = None

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn
# glm5::DType codes (csrc/core.h)
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, FP8: 3, torch.int32: 4, torch.int64: 5}
threads = torch.get_num_threads


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last] with a unit stride along the last dim (copies only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def readable_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` [R, D] with unit last stride and non-overlapping rows (copied only if not), and its
    row stride in elements."""
    rows, dim = t.shape
    if (dim > 1 and t.stride(1) != 1) or (rows > 1 and t.stride(0) < dim):
        t = t.contiguous()
    return t, (t.stride(0) if rows > 1 else dim)


def readable_pages(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A paged cache [num_blocks, block_size, D] readable in place, with its block and row
    strides in elements (copied only for layouts with overlapping rows or a strided last dim)."""
    blocks, size, dim = t.shape
    row = t.stride(1) if size > 1 else dim
    block = t.stride(0) if blocks > 1 else (size - 1) * row + dim
    if (dim > 1 and t.stride(2) != 1) or row < dim or block < (size - 1) * row + dim:
        t = t.contiguous()
        row, block = dim, size * dim
    return t, block, row


def readable_page_scales(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """FP8 scales [num_blocks, block_size] with their block and row strides."""
    blocks, size = t.shape
    row = t.stride(1) if size > 1 else 1
    block = t.stride(0) if blocks > 1 else (size - 1) * row + 1
    if row < 1 or block < (size - 1) * row + 1:
        t = t.contiguous()
        row, block = 1, size
    return t, block, row
