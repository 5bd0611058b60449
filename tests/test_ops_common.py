"""silu_and_mul, apply_rope, hadamard_transform (docs/ops/common.md): reference semantics
pinned by independent formulations, the input contract, autograd, opcheck and torch.compile.
(rms_norm has its own file, tests/test_rms_norm.py.)"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import glm5_hal as hal

from conftest import REPO, assert_invalid, seeded

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# one rounding of the output on top of float32 computation
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def assert_rounded_from(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, atol: float | None = None):
    """`out` is `exact` (float64) computed in float32 and rounded once to `dtype`."""
    assert out.dtype == dtype and out.shape == exact.shape
    rtol, default_atol = TOL[dtype]
    torch.testing.assert_close(out.double(), exact.to(dtype).double(), rtol=rtol,
                               atol=default_atol if atol is None else atol)


# -- silu_and_mul ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2,), (3, 34), (2, 5, 256), (0, 6)])
def test_silu_and_mul_is_gate_times_sigmoid_gate_times_up(dtype, shape):
    x = (torch.randn(shape, generator=seeded(1)) * 4).to(dtype)
    n = shape[-1] // 2
    gate, up = x.double()[..., :n], x.double()[..., n:]
    exact = gate / (1 + torch.exp(-gate)) * up
    assert_rounded_from(hal.ops.silu_and_mul(x), exact, dtype)
    assert hal.ops.silu_and_mul(x).shape == (*shape[:-1], n)


def test_silu_and_mul_reference_matches_torch_silu_in_float64():
    x = torch.randn(7, 20, generator=seeded(2), dtype=torch.float64) * 10
    expected = F.silu(x[:, :10]) * x[:, 10:]
    torch.testing.assert_close(hal.reference.silu_and_mul(x), expected, rtol=1e-14, atol=1e-14)


# -- apply_rope ------------------------------------------------------------------------------

def inverse_frequencies(rot_dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i/R) written the way model code usually writes it, in float64."""
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))


def rope_by_complex_multiplication(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Interleaved rope as in DeepSeek/GLM code: pairs are complex numbers times e^(i angle)."""
    t, h, r = x.shape
    angles = positions.double()[:, None] * inverse_frequencies(r, theta)[None, :]
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    z = torch.view_as_complex(x.double().reshape(t, h, r // 2, 2).contiguous())
    return torch.view_as_real(z * rotation).reshape(t, h, r)


def rope_by_rotate_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split (NeoX) rope as in HF transformers: x * cos + rotate_half(x) * sin."""
    r = x.shape[-1]
    freqs = positions.double()[:, None] * inverse_frequencies(r, theta)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    xd = x.double()
    rotated_half = torch.cat((-xd[..., r // 2:], xd[..., : r // 2]), dim=-1)
    return xd * emb.cos() + rotated_half * emb.sin()


ROPE_FORMULAS = {True: rope_by_complex_multiplication, False: rope_by_rotate_half}


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1, 2), (5, 3, 64), (17, 2, 10), (0, 4, 8)])
def test_rope_matches_the_textbook_formula(interleaved, dtype, shape):
    g = seeded(3)
    x = torch.randn(shape, generator=g).to(dtype)
    positions = torch.randint(0, 40, (shape[0],), generator=g)
    out = hal.ops.apply_rope(x, positions, 1e4, interleaved)
    # float32 angles of positions < 40 are within ~3e-6 rad of the exact ones
    assert_rounded_from(out, ROPE_FORMULAS[interleaved](x, positions, 1e4), dtype,
                        atol=5e-5 if dtype == torch.float32 else None)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_reference_in_float64_is_exact_at_long_positions(interleaved):
    g = seeded(4)
    x = torch.randn(9, 2, 64, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 202752, (9,), generator=g)
    torch.testing.assert_close(hal.reference.apply_rope(x, positions, 1e6, interleaved),
                               ROPE_FORMULAS[interleaved](x, positions, 1e6), rtol=1e-9, atol=1e-9)


def test_rope_pairs_the_right_elements():
    # inv_freq_0 = theta^0 = 1, so the first pair turns by `position` radians
    c, s = math.cos(1.0), math.sin(1.0)
    x = torch.tensor([[[1.0, 2.0, 0.0, 0.0]]], dtype=torch.float64)
    interleaved = hal.reference.apply_rope(x, torch.tensor([1]), 10.0, True)
    torch.testing.assert_close(interleaved, torch.tensor([[[c - 2 * s, s + 2 * c, 0.0, 0.0]]], dtype=torch.float64))
    x = torch.tensor([[[1.0, 0.0, 2.0, 0.0]]], dtype=torch.float64)
    half_split = hal.reference.apply_rope(x, torch.tensor([1]), 10.0, False)
    torch.testing.assert_close(half_split, torch.tensor([[[c - 2 * s, 0.0, s + 2 * c, 0.0]]], dtype=torch.float64))
    at_zero = torch.randn(1, 3, 8, generator=seeded(14))
    torch.testing.assert_close(hal.ops.apply_rope(at_zero, torch.tensor([0]), 1e4, True), at_zero, rtol=0, atol=0)


def test_rope_accepts_int32_and_int64_positions_alike():
    x = torch.randn(6, 2, 16, generator=seeded(5))
    positions = torch.tensor([0, 1, 5, 100, 7, 3])
    torch.testing.assert_close(hal.ops.apply_rope(x, positions.int(), 1e6, True),
                               hal.ops.apply_rope(x, positions.long(), 1e6, True), rtol=0, atol=0)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(m=st.integers(0, 5000), n=st.integers(0, 5000), half_dim=st.integers(1, 32),
       interleaved=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rope_scores_depend_only_on_relative_position(m, n, half_dim, interleaved, seed):
    # the property rope exists for: <rope(q, m), rope(k, n)> = <rope(q, m - n), k>
    g = seeded(seed)
    q = torch.randn(1, 1, 2 * half_dim, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 2 * half_dim, generator=g, dtype=torch.float64)
    rope = hal.reference.apply_rope
    lhs = (rope(q, torch.tensor([m]), 1e4, interleaved) * rope(k, torch.tensor([n]), 1e4, interleaved)).sum()
    rhs = (rope(q, torch.tensor([m - n]), 1e4, interleaved) * k).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-9, atol=1e-9)
    # and rotations preserve the norm of every pair
    assert math.isclose(rope(q, torch.tensor([m]), 1e4, interleaved).norm(), q.norm(), rel_tol=1e-12)


# -- hadamard_transform ----------------------------------------------------------------------

def hadamard_by_popcount(d: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix by its closed form H[i, j] = (-1)^popcount(i & j)."""
    i = torch.arange(d)
    bits = (i[:, None] & i[None, :])
    popcount = torch.zeros_like(bits)
    for b in range(max(d.bit_length(), 1)):
        popcount += (bits >> b) & 1
    return (1 - 2 * (popcount % 2)).double()


def hadamard_by_recursion(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 128])
def test_sylvester_matrix_closed_form_is_the_recursion_and_orthogonal(d):
    h = hadamard_by_popcount(d)
    assert torch.equal(h, hadamard_by_recursion(d))
    assert torch.equal(h @ h, d * torch.eye(d, dtype=torch.float64))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(3, 1), (3, 2), (5, 8), (2, 3, 128), (256,), (0, 16)])
def test_hadamard_transform_is_x_times_h_times_scale(dtype, shape):
    d = shape[-1]
    x = torch.randn(shape, generator=seeded(6)).to(dtype)
    scale = d ** -0.5
    exact = x.double() @ hadamard_by_popcount(d) * scale
    assert_rounded_from(hal.ops.hadamard_transform(x, scale), exact, dtype,
                        atol=1e-5 * math.log2(2 * d))


def test_hadamard_reference_in_float64_is_exact():
    x = torch.randn(4, 512, generator=seeded(7), dtype=torch.float64)
    torch.testing.assert_close(hal.reference.hadamard_transform(x, 0.5), x @ hadamard_by_popcount(512) * 0.5,
                               rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(log_d=st.integers(0, 9), rows=st.integers(0, 6), seed=st.integers(0, 2**31 - 1))
def test_orthonormal_hadamard_is_an_involution(log_d, rows, seed):
    d = 2 ** log_d
    x = torch.randn(rows, d, generator=seeded(seed), dtype=torch.float64)
    once = hal.reference.hadamard_transform(x, d ** -0.5)
    torch.testing.assert_close(hal.reference.hadamard_transform(once, d ** -0.5), x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(once.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)


# -- layouts ---------------------------------------------------------------------------------

def test_non_contiguous_inputs_give_the_contiguous_result():
    g = seeded(8)
    wide = torch.randn(6, 3, 32, generator=g).transpose(0, 1)  # [3, 6, 32], strided heads
    positions = torch.arange(3)
    assert not wide.is_contiguous()
    for fn in (lambda t: hal.ops.silu_and_mul(t), lambda t: hal.ops.hadamard_transform(t, 0.3),
               lambda t: hal.ops.apply_rope(t, positions, 1e4, True),
               lambda t: hal.ops.apply_rope(t, positions, 1e4, False)):
        torch.testing.assert_close(fn(wide), fn(wide.contiguous()), rtol=0, atol=0)
    strided_last = torch.randn(4, 64, generator=g)[:, ::2]
    torch.testing.assert_close(hal.ops.hadamard_transform(strided_last, 1.0),
                               hal.ops.hadamard_transform(strided_last.contiguous(), 1.0), rtol=0, atol=0)


# -- input contract --------------------------------------------------------------------------

X3 = lambda: torch.randn(4, 2, 8)  # noqa: E731
POS = lambda: torch.arange(4)  # noqa: E731

BAD = [
    ("silu_and_mul", lambda: (torch.randn(3, 8).numpy(),), "x", "a torch.Tensor"),
    ("silu_and_mul", lambda: (torch.tensor(1.0),), "x", "at least 1 dims"),
    ("silu_and_mul", lambda: (torch.ones(3, 8, dtype=torch.int32),), "x", "dtype float32 or float16 or bfloat16"),
    ("silu_and_mul", lambda: (torch.randn(3, 8, dtype=torch.float64),), "x", "dtype float32"),
    ("silu_and_mul", lambda: (torch.randn(3, 7),), "x", "an even last dim >= 2"),
    ("silu_and_mul", lambda: (torch.randn(3, 0),), "x", "an even last dim >= 2"),
    ("apply_rope", lambda: (torch.randn(4, 8), POS(), 1e4, True), "x", "a 3-d tensor"),
    ("apply_rope", lambda: (torch.ones(4, 2, 8, dtype=torch.int32), POS(), 1e4, True), "x", "dtype float32"),
    ("apply_rope", lambda: (torch.randn(4, 2, 7), POS(), 1e4, True), "x", "an even rotary dim"),
    ("apply_rope", lambda: (torch.randn(4, 2, 0), POS(), 1e4, True), "x", "an even rotary dim"),
    ("apply_rope", lambda: (X3(), POS().float(), 1e4, True), "positions", "dtype int32 or int64"),
    ("apply_rope", lambda: (X3(), POS()[None], 1e4, True), "positions", "a 1-d tensor"),
    ("apply_rope", lambda: (X3(), torch.arange(5), 1e4, True), "positions", "shape [4]"),
    ("apply_rope", lambda: (X3(), POS().to("meta"), 1e4, True), "positions", "a tensor on cpu"),
    ("apply_rope", lambda: (X3(), POS(), 0.0, True), "theta", "a number > 0.0"),
    ("apply_rope", lambda: (X3(), POS(), -1e4, True), "theta", "a number > 0.0"),
    ("apply_rope", lambda: (X3(), POS(), float("nan"), True), "theta", "a finite number"),
    ("apply_rope", lambda: (X3(), POS(), "1e4", True), "theta", "a finite number"),
    ("apply_rope", lambda: (X3(), POS(), 1e4, 1), "interleaved", "a bool"),
    ("apply_rope", lambda: (X3(), POS(), 1e4, None), "interleaved", "a bool"),
    ("hadamard_transform", lambda: (torch.randn(3, 12), 1.0), "x", "a power of two"),
    ("hadamard_transform", lambda: (torch.randn(3, 0), 1.0), "x", "a power of two"),
    ("hadamard_transform", lambda: (torch.tensor(2.0), 1.0), "x", "at least 1 dims"),
    ("hadamard_transform", lambda: (torch.ones(3, 8, dtype=torch.int64), 1.0), "x", "dtype float32"),
    ("hadamard_transform", lambda: (torch.randn(3, 8), float("inf")), "scale", "a finite number"),
    ("hadamard_transform", lambda: (torch.randn(3, 8), None), "scale", "a finite number"),
]


@pytest.mark.parametrize("op,make,arg,expected", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_invalid_input_error(op, make, arg, expected):
    assert_invalid(getattr(hal.ops, op), make(), op, arg, expected)


def test_finite_scale_may_be_any_sign_or_an_int():
    x = torch.randn(2, 4, generator=seeded(9))
    torch.testing.assert_close(hal.ops.hadamard_transform(x, -2), -2 * hal.ops.hadamard_transform(x, 1.0))


# -- autograd, opcheck, torch.compile --------------------------------------------------------

CASES = {
    "silu_and_mul": lambda g: (torch.randn(3, 2, 16, generator=g),),
    "apply_rope_interleaved": lambda g: (torch.randn(5, 3, 8, generator=g), torch.tensor([0, 3, 1, 9, 2]), 1e4, True),
    "apply_rope_half_split": lambda g: (torch.randn(5, 3, 8, generator=g), torch.tensor([0, 3, 1, 9, 2], dtype=torch.int32),
                                        1e6, False),
    "hadamard_transform": lambda g: (torch.randn(3, 2, 32, generator=g), 32 ** -0.5),
}


def op_name(case: str) -> str:
    return case.removesuffix("_interleaved").removesuffix("_half_split")


def with_grad(args: tuple, dtype=None) -> tuple:
    return tuple(a.to(dtype or a.dtype).detach().requires_grad_() if isinstance(a, torch.Tensor)
                 and a.is_floating_point() else a for a in args)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(case, dtype):
    args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in CASES[case](seeded(10)))
    torch_op = getattr(torch.ops.glm5_hal, op_name(case)).default
    torch.library.opcheck(torch_op, args)
    torch.library.opcheck(torch_op, with_grad(args))


@pytest.mark.parametrize("case", CASES)
def test_backward_is_the_reference_vjp_and_gradchecks(case):
    args = CASES[case](seeded(11))
    op, reference = getattr(hal.ops, op_name(case)), getattr(hal.reference, op_name(case))
    upstream = torch.randn(op(*args).shape, generator=seeded(12))
    a1, a2 = with_grad(args), with_grad(args)
    op(*a1).backward(upstream)
    reference(*a2).backward(upstream)
    torch.testing.assert_close(a1[0].grad, a2[0].grad)
    assert torch.autograd.gradcheck(lambda t: reference(t, *args[1:]), with_grad(args[:1], torch.float64))


@pytest.mark.parametrize("case", CASES)
def test_compile_fullgraph_forward_and_backward(case):
    torch._dynamo.reset()
    op = getattr(hal.ops, op_name(case))
    args = CASES[case](seeded(13))

    def f(*a):
        return op(*a) * 2 + 1

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(*args), f(*args))
    a1, a2 = with_grad(args), with_grad(args)
    compiled(*a1).sum().backward()
    f(*a2).sum().backward()
    torch.testing.assert_close(a1[0].grad, a2[0].grad)


def test_compiled_call_validates_at_trace_time():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: hal.ops.hadamard_transform(x, 1.0), fullgraph=True)
    with pytest.raises(Exception, match="argument 'x'.*power of two"):
        compiled(torch.randn(2, 24))


def test_compile_with_dynamic_shapes():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, p: hal.ops.hadamard_transform(hal.ops.apply_rope(x, p, 1e6, True), 0.25),
                             fullgraph=True, dynamic=True)
    for t in (3, 7):
        x, p = torch.randn(t, 2, 16, generator=seeded(t)), torch.arange(t)
        torch.testing.assert_close(compiled(x, p), hal.ops.hadamard_transform(hal.ops.apply_rope(x, p, 1e6, True), 0.25))


# -- docs ------------------------------------------------------------------------------------

def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_docs_examples_run():
    blocks = python_blocks(REPO / "docs" / "ops" / "common.md")
    assert len(blocks) >= 4  # one per op
    for block in blocks:
        exec(compile(block, "docs/ops/common.md", "exec"), {})


def test_references_create_nothing_off_the_input_device():
    # meta tensors fail on any mix with a tensor made on the CPU: a cheap stand-in for a GPU
    meta = torch.device("meta")
    x = torch.empty(3, 2, 16, device=meta)
    for positions in (torch.empty(3, dtype=torch.int32, device=meta), torch.empty(3, dtype=torch.int64, device=meta)):
        for interleaved in (True, False):
            assert hal.reference.apply_rope(x, positions, 1e4, interleaved).device == meta
    assert hal.reference.silu_and_mul(x).shape == (3, 2, 8)
    assert hal.reference.hadamard_transform(x, 0.25).device == meta
