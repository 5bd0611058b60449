"""The cpu backend implements every op of the registry for every dtype the op takes, so no
op falls back to the reference on CPU tensors (no FallbackWarning), and its own implementation
passes every conformance case of the tiny preset."""
from __future__ import annotations

import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.conformance import runner, suite
from glm5_hal.conformance.case import ERROR
from glm5_hal.conformance.cases import cases, ops_with_cases
from glm5_hal.opdef import OPS
from glm5_hal.registry import FallbackWarning

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
# The dtype the dispatch argument takes, where it is not the activation floats.
DISPATCH_DTYPES = {"int4_unpack": frozenset({torch.int32}),
                   "fp8_block_gemm": frozenset({torch.float8_e4m3fn}), "fp8_grouped_gemm": frozenset({torch.float8_e4m3fn}),
                   "int8_gemm": frozenset({torch.int8}), "int8_grouped_gemm": frozenset({torch.int8})}


def test_cpu_backend_implements_every_op_for_every_dtype():
    hal.ops.rms_norm  # noqa: B018  (defines every op)
    cpu = hal.get_backend("cpu")
    assert cpu.availability().available
    impls = cpu.impls
    missing = sorted(op for op in OPS if op not in impls)
    assert not missing, f"ops without a cpu implementation: {missing}"
    for op, impl in impls.items():
        wanted = DISPATCH_DTYPES.get(op, FLOATS)
        assert impl.dtypes is None or wanted <= impl.dtypes, (op, impl.dtypes)
        assert impl.supports is None, f"{op}: a supports() predicate could decline calls"


@pytest.mark.parametrize("dtype", sorted(FLOATS, key=str), ids=str)
def test_a_moe_layer_on_cpu_never_falls_back(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        weights, ids = hal.ops.moe_route(torch.randn(6, 16, generator=g).to(dtype), None, 4)
        xp, counts, src = hal.ops.moe_permute(hal.ops.rms_norm(x, torch.ones(64), 1e-5), ids, 16)
        h = hal.ops.silu_and_mul(hal.ops.grouped_gemm(xp, torch.randn(16, 32, 64, generator=g).to(dtype), counts))
        y = hal.ops.grouped_gemm(h, torch.randn(16, 64, 16, generator=g).to(dtype), counts)
        out = hal.ops.moe_unpermute(y, src, weights)
    assert out.shape == x.shape and out.dtype == dtype
    assert not any(k[1] == "cpu" for k in hal.fallback_stats())


def own_implementation_problems(backend: str, op: str) -> list[tuple[str, str, str, str]]:
    """The tiny cases of `op` that `backend` does not pass with its own implementation:
    (case, status, implementation, reason). Expected-error cases are rejected by the op's
    checks before dispatch chooses anything (implementation "")."""
    errors = {c.id for c in cases(op, "tiny") if c.outcome == ERROR}
    records = runner.run_all(suite.plan([backend], [op], ["tiny"]))
    assert records
    return [(r.case, r.status, r.impl, r.reason[:200]) for r in records
            if r.status != "pass" or r.impl != ("" if r.case in errors else f"{backend}.{op}")]


@pytest.mark.parametrize("op", ops_with_cases())
def test_the_cpu_backend_passes_every_tiny_case_with_its_own_implementation(op):
    assert own_implementation_problems("cpu", op) == []


def test_a_backend_that_declines_some_calls_has_coverage_problems(hal_state):
    """The check above on a cpu-like backend that takes rms_norm in float32 only."""
    import types

    class Partial(hal.Backend):
        name, device_type, priority = "partialcpu", "cpu", -1

    partial = Partial()
    partial.impl("rms_norm", dtypes=(torch.float32,))(hal.get_backend("cpu").impls["rms_norm"].fn)
    module = types.ModuleType("partialcpu")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(partial))
    hal_state(module, "partialcpu")
    problems = own_implementation_problems("partialcpu", "rms_norm")
    assert problems and {p[1] for p in problems} == {"fallback"}
    assert {p[0].rsplit("/", 1)[1] for p in problems} == {"float16", "bfloat16"}
