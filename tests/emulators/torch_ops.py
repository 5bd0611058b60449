"""Emulation of upstream PyTorch's torch._grouped_mm argument checks and result, which Hygon's
ROCm/DTK build of torch exposes (the dcu adapters call it; the dcu emulator adds its device
rules around it).

From pytorch/pytorch aten/src/ATen/native/GroupedMMUtils.h @2295ac79:
check_valid_strides_and_return_transposed (data 16-byte aligned off the CPU; one of the last two
strides 1 and the other a multiple of 16 bytes), _grouped_mm_validate_inputs (float32 / bfloat16
/ float16, 2-D or 3-D, offsets for a 2-D operand, 1-D int32; bias not supported),
_resolve_grouped_mm_out_dtype (the output dtype is mat_a's) and _grouped_mm_fallback (the
2-D x 3-D form: rows [offs[g-1], offs[g]) of a times b[g]; it reads offs on the host). It never
calls glm5_hal.reference.
"""
from __future__ import annotations

import torch
from torch import Tensor


class TorchCheckError(RuntimeError):
    """What TORCH_CHECK raises."""


class GroupedMmNotEmulated(RuntimeError):
    """A form of _grouped_mm the vendor sources do not document."""


def _check(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise TorchCheckError(f"{op}: {message}")


def _valid_strides(op: str, mat: Tensor) -> bool:
    """True for a transposed (column-major) matrix, False for a row-major one."""
    _check(mat.data_ptr() % 16 == 0, op, "expected data_ptr to be aligned to 16 bytes")
    strides, sizes = mat.stride(), mat.shape
    alignment = 16 // mat.element_size()
    end = mat.dim() - 1
    if strides[end - 1] == 1 and strides[end] >= max(1, sizes[end - 1]):
        _check(strides[end] % alignment == 0, op, "strides should be multiple of 16 bytes")
        return True
    if strides[end] == 1 and strides[end - 1] >= max(1, sizes[end]):
        _check(strides[end - 1] % alignment == 0, op, "strides should be multiple of 16 bytes")
        return False
    raise TorchCheckError(f"{op}: Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes")


def grouped_mm(op: str, mat_a: Tensor, mat_b: Tensor, offs: Tensor | None, bias: Tensor | None,
               out_dtype: torch.dtype | None) -> Tensor:
    _check(mat_a.dtype == mat_b.dtype, op, f"mat_a and mat_b must have the same dtype, got {mat_a.dtype} and "
           f"{mat_b.dtype}")
    _check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), op, "mat_a and mat_b have to be 2 or 3d")
    if (mat_a.dim(), mat_b.dim()) != (2, 3):
        raise GroupedMmNotEmulated(f"{op}: only the 2-D x 3-D form (the MoE layout) is emulated")
    _check(bias is None, op, "Bias not supported yet")
    if out_dtype is not None and out_dtype != mat_a.dtype:
        raise GroupedMmNotEmulated(f"{op}: out_dtype other than the input dtype is not emulated, got {out_dtype}")
    _valid_strides(op, mat_a)
    _valid_strides(op, mat_b)
    _check(mat_a.shape[1] == mat_b.shape[1], op, "contraction dimension of mat_a and mat_b must match")
    _check(offs is not None, op, "offs needs to be provided for 2d-3d grouped mm")
    _check(offs.dtype == torch.int32 and offs.dim() == 1, op, "offs has to be a 1D int32 tensor")
    _check(offs.shape[0] == mat_b.shape[0], op, f"offs has {offs.shape[0]} groups, mat_b has {mat_b.shape[0]}")
    ends = [int(v) for v in offs.tolist()]
    # the device kernel trusts offs: rows outside [0, M) would be read out of bounds
    _check(all(a <= b for a, b in zip([0] + ends, ends)) and (not ends or ends[-1] <= mat_a.shape[0]), op,
           f"offs must be non-decreasing end offsets within [0, {mat_a.shape[0]}], got {ends}")
    out = torch.full((mat_a.shape[0], mat_b.shape[2]), float("nan"), dtype=mat_a.dtype)  # rows past offs[-1]
    start = 0
    for group, end in enumerate(ends):
        if end > start:
            out[start:end] = (mat_a[start:end].float() @ mat_b[group].float()).to(mat_a.dtype)
        start = end
    return out
