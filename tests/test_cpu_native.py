"""glm5_hal._C's binding layer (csrc/bindings.cpp, csrc/view.h): tensor arguments become the
kernels' views with the tensor's own geometry; an input whose layout a kernel cannot read in
place is copied, an output never is; a glm5_hal._C.View built by keyword is passed as it is."""
from __future__ import annotations

import pytest
import torch

import glm5_hal as hal
from glm5_hal import InvalidInputError, _C

from cpu_helpers import native_view

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.int64)


def test_a_view_is_the_tensors_geometry():
    t = torch.randn(4, 6, 8)[:, 1:5, ::2]
    v = _C.View(t)
    assert (v.data, v.dtype, v.size, v.stride) == (t.data_ptr(), 0, tuple(t.shape), t.stride())
    assert [_C.View(torch.empty(1, dtype=d)).dtype for d in DTYPES] == list(range(6))  # glm5::DType codes
    explicit = _C.View(data=v.data, dtype=1, size=(2, 3), stride=(3, 1))
    assert (explicit.data, explicit.dtype, explicit.size, explicit.stride) == (v.data, 1, (2, 3), (3, 1))
    with pytest.raises(ValueError):
        _C.View(data=0, dtype=0, size=(2,), stride=(1, 1))


def test_inputs_without_the_kernels_layout_are_copied():
    w = torch.randn(16)
    for x in (torch.randn(16, 10).t(),           # no rows of a unit last stride
              torch.randn(4, 6, 16)[:, :3],      # leading dims that do not merge into one row stride
              torch.randn(3, 32)[:, ::2]):       # strided last dim
        before = x.clone()
        out = torch.empty(x.shape)
        _C.rms_norm(out, x, w, 1e-6, 1)
        torch.testing.assert_close(out, hal.reference.rms_norm(x, w, 1e-6))
        assert torch.equal(x, before)
    # a subclass of torch.Tensor takes the generic attribute calls
    out = torch.empty(3, 16)
    x = torch.randn(3, 16)
    _C.rms_norm(out, x, torch.nn.Parameter(w, requires_grad=False), 1e-6, 1)
    torch.testing.assert_close(out, hal.reference.rms_norm(x, w, 1e-6))


def test_more_dims_than_a_view_holds():
    x = torch.randn(*[2] * 9, 8)                    # 10 dims: the leading ones merge
    w = torch.randn(8)
    out = torch.empty(x.shape)
    _C.rms_norm(out, x, w, 1e-6, 1)
    torch.testing.assert_close(out, hal.reference.rms_norm(x, w, 1e-6))
    xt = x.transpose(0, 8)                          # an input that cannot merge: copied
    _C.rms_norm(out, xt, w, 1e-6, 1)
    torch.testing.assert_close(out, hal.reference.rms_norm(xt, w, 1e-6))
    with pytest.raises(InvalidInputError, match="at most 8 dims") as info:  # an output: never copied
        _C.rms_norm(torch.empty(x.shape).transpose(0, 8), x, w, 1e-6, 1)
    assert (info.value.op, info.value.arg) == ("rms_norm", "out")


def test_outputs_and_explicit_views_are_never_copied():
    x, w = torch.randn(8, 4), torch.randn(4)
    out = torch.full((4, 8), 7.0)
    with pytest.raises(InvalidInputError) as info:                   # a transposed output
        _C.rms_norm(out.t(), x, w, 1e-6, 1)
    assert info.value.arg == "out" and (out == 7.0).all()
    xt = torch.randn(4, 8).t()
    with pytest.raises(InvalidInputError, match="unit stride") as info:  # the same layout as an explicit View
        _C.rms_norm(torch.empty(8, 4), native_view(xt), w, 1e-6, 1)
    assert info.value.arg == "x"


def test_arguments_that_are_no_tensor_of_a_kernel_dtype():
    out, w = torch.empty(2, 4), torch.randn(4)
    with pytest.raises(InvalidInputError, match="torch.uint8") as info:
        _C.rms_norm(out, torch.zeros(2, 4, dtype=torch.uint8), w, 1e-6, 1)
    assert (info.value.op, info.value.arg, info.value.backend) == ("rms_norm", "x", "cpu")
    with pytest.raises(InvalidInputError, match="a torch.Tensor or a glm5_hal._C.View") as info:
        _C.rms_norm(out, [[1.0] * 4] * 2, w, 1e-6, 1)
    assert info.value.arg == "x"


def test_two_phase_ops_allocate_their_output():
    cache = torch.randn(4, 4, 8)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    got = _C.kv_cache_gather(None, cache, table, lens, 1)
    out = torch.empty(9, 8)
    assert _C.kv_cache_gather(out, cache, table, lens, 1) is out
    assert torch.equal(got, out) and torch.equal(got, hal.reference.kv_cache_gather(cache, table, lens))
    x = torch.randn(5, 6)
    ids = torch.tensor([[0, 2], [1, -1], [2, 2], [0, 9], [1, 0]], dtype=torch.int32)
    tpe, src = torch.empty(3, dtype=torch.int32), torch.empty(10, dtype=torch.int32)
    x_perm = _C.moe_permute(tpe, src, x, ids, 1)
    want_x, want_tpe, want_src = hal.reference.moe_permute(x, ids, 3)
    assert torch.equal(x_perm, want_x) and torch.equal(tpe, want_tpe) and torch.equal(src[:8], want_src)
