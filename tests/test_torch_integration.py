"""Every op is also torch.ops.glm5_hal.<op>: compiled graphs, opcheck, autograd."""
from __future__ import annotations

import pytest
import torch

import glm5_hal as hal


def test_compile_fullgraph_over_model_code():
    torch._dynamo.reset()

    def block(x, w):
        return hal.ops.rms_norm(x, w, 1e-5) * 2 + 1

    x, w = torch.randn(5, 32), torch.randn(32)
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x, w), block(x, w))


def test_compiled_call_still_validates_at_trace_time():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: hal.ops.rms_norm(x, w, 1e-5), fullgraph=True)
    with pytest.raises(Exception, match="argument 'weight'"):
        compiled(torch.randn(5, 32), torch.randn(31))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_rms_norm(dtype):
    x = torch.randn(3, 16, dtype=dtype)
    w = torch.randn(16)
    torch.library.opcheck(torch.ops.glm5_hal.rms_norm.default, (x, w, 1e-5))
    torch.library.opcheck(torch.ops.glm5_hal.rms_norm.default,
                          (x.clone().requires_grad_(), w.clone().requires_grad_(), 1e-5))


def test_rms_norm_backward_matches_reference_and_gradcheck():
    x = torch.randn(4, 24, dtype=torch.float64)
    w = torch.randn(24, dtype=torch.float64)
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    hal.ops.rms_norm(xf, wf, 1e-5).pow(2).sum().backward()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    hal.reference.rms_norm(xr, wr, 1e-5).pow(2).sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad)
    torch.testing.assert_close(wf.grad, wr.grad)
    # the registered backward is the reference's VJP (equal above); gradcheck that in float64
    assert torch.autograd.gradcheck(lambda a, b: hal.reference.rms_norm(a, b, 1e-5),
                                    (x.requires_grad_(), w.requires_grad_()))
