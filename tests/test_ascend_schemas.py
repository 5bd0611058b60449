"""The Ascend adapters against torch_npu's own op schemas: the emulator registers the
schemas of the torch-npu wheel (`torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`,
unpacked by scripts/fetch_torch_npu.sh) with torch.library, so torch's schema parser checks
every call an adapter makes. Runs against every wheel unpacked under build/torch_npu; CI
unpacks the pinned one first (GLM5_CI_REQUIRE_TORCH_NPU_WHEEL=1 makes its absence a failure)."""
from __future__ import annotations

import types

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends.ascend import AscendBackend, versions
from glm5_hal.vendor_backend import leading_numbers
from emulators import npu_schemas
from emulators.ascend import EMULATED_OPS, NpuEmulator

from conftest import seeded
from emulated_helpers import verdict

EMU = "ascend_schema_emu"
VERSIONS = npu_schemas.available_versions()


def _missing(version: str):
    if npu_schemas.required():
        pytest.fail(f"GLM5_CI_REQUIRE_TORCH_NPU_WHEEL is set but {npu_schemas.missing_reason(version)}")
    pytest.skip(npu_schemas.missing_reason(version))


@pytest.fixture
def pinned():
    if not npu_schemas.available(npu_schemas.PINNED):
        _missing(npu_schemas.PINNED)
    return npu_schemas.PINNED


def test_the_pinned_wheel_drives_the_default_emulator(pinned):
    emulator = NpuEmulator("910B")
    assert emulator.__version__ == pinned and emulator.schemas is not None
    assert emulator.schemas.source == f"torch-npu {pinned} wheel, {npu_schemas.SCHEMA_FILE}"
    assert emulator.schemas.schema("npu_rms_norm").endswith(
        "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=9.9999999999999995e-07) -> (Tensor, Tensor)")


def test_an_argument_or_op_the_wheel_does_not_declare_fails(pinned):
    emulator = NpuEmulator("910B")
    x, gamma = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'eps'"):
        emulator.npu_rms_norm(x, gamma, eps=1e-6)
    with pytest.raises(RuntimeError, match="expected at most 3 argument"):
        emulator.npu_rms_norm(x, gamma, 1e-6, True)
    with pytest.raises(AttributeError, match="module 'torch_npu' has no attribute 'npu_rms_norm_v9'"):
        emulator.npu_rms_norm_v9(x, gamma)


@pytest.mark.parametrize("version", VERSIONS or ["(none unpacked)"])
def test_the_emulator_honours_every_argument_each_wheel_declares(version):
    """No schema argument reaches an emulator method that would silently ignore it."""
    if version not in VERSIONS:
        _missing(npu_schemas.PINNED)
    declared = npu_schemas.read_schemas(version)
    for op in EMULATED_OPS:
        method = getattr(NpuEmulator, op)
        known = set(method.__code__.co_varnames[1: method.__code__.co_argcount + method.__code__.co_kwonlyargcount])
        for schema in declared.get(op, ()):
            args = [a.split("=")[0].split()[-1] for a in schema.split("(", 1)[1].rsplit(") ->", 1)[0].split(", ")
                    if a and a != "*"]
            unknown = {("self_tensor" if a == "self" else a) for a in args} - known
            assert not unknown, f"torch-npu {version}: {schema} has arguments {unknown} the emulator does not take"


def adapter_calls():
    """One call per adapter (CPU tensors, emulated backend): (op, args)."""
    g = seeded(60)
    table = torch.tensor([[3, 0, -1], [1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    w = torch.randint(-127, 128, (2, 1, 16), generator=g).float() / 64
    kv = (torch.randn(4, 16, 576, generator=g) * 0.3).to(torch.bfloat16)
    bf = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    i8 = lambda *shape: torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)  # noqa: E731
    return [
        ("rms_norm", (bf(3, 64), bf(64), 1e-6)),
        ("silu_and_mul", (bf(3, 64),)),
        ("apply_rope", (bf(3, 4, 64), torch.tensor([0, 1, 7]), 1e4, False)),
        ("indexer_topk", (bf(3, 16, 128), bf(6, 128), w[0].expand(3, 16).contiguous(),
                          torch.zeros(3, dtype=torch.int32), torch.tensor([2, 4, 6], dtype=torch.int32), 8)),
        ("indexer_topk_paged", (bf(2, 1, 16, 128), bf(4, 16, 128), w, table, lens, 48)),
        ("sparse_mla_attention", (bf(3, 8, 576), kv[0], torch.randint(-1, 16, (3, 8), generator=g,
                                                                       dtype=torch.int32), 0.06, 512)),
        ("sparse_mla_decode_paged", (bf(2, 1, 8, 576), kv, table, lens,
                                     torch.randint(-1, 20, (2, 1, 8), generator=g, dtype=torch.int32), 0.06, 512)),
        ("moe_route", (bf(3, 64), torch.zeros(64), 4, 1, 1, 1.0, True, "sigmoid")),
        ("moe_permute", (bf(3, 32), torch.tensor([[0, 5], [2, -1], [7, 0]], dtype=torch.int32), 8)),
        ("moe_unpermute", (bf(4, 32), torch.tensor([0, 2, 4, 5], dtype=torch.int32), torch.rand(3, 2, generator=g))),
        ("grouped_gemm", (bf(5, 32), bf(2, 16, 32), torch.tensor([2, 3], dtype=torch.int32))),
        ("kv_cache_write", (bf(2, 16, 64), bf(3, 64), torch.tensor([4, -1, 30], dtype=torch.int32))),
        ("int8_quant", (bf(3, 64),)),
        ("int8_gemm", (i8(3, 64), torch.rand(3, generator=g), i8(16, 64), torch.rand(16, generator=g), torch.bfloat16,
                       None)),
        ("int8_grouped_gemm", (i8(5, 64), torch.rand(5, generator=g), i8(2, 16, 64), torch.rand(2, 16, generator=g),
                               torch.tensor([2, 3], dtype=torch.int32), torch.float16)),
    ]


@pytest.mark.parametrize("version", VERSIONS or ["(none unpacked)"])
def test_every_adapter_call_parses_against_each_wheel(hal_state, monkeypatch, version):
    """Each adapter, through dispatch, against the emulator of torch-npu `version`: every call
    that reaches the vendor parses against that wheel's schemas (a mismatch raises inside the
    adapter: the test fails); the DSA adapters reach it exactly where versions.DSA_OPS says
    the wheel has the ops. Matches the reference."""
    if version not in VERSIONS:
        _missing(npu_schemas.PINNED)
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = AscendBackend(runtime=NpuEmulator("910B", version=version), name=EMU, device_type="cpu",
                            priority=1000, vendor_precision=True)
    plugin = types.ModuleType("ascend_schema_plugin")
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(plugin, EMU)
    assert backend.availability().available
    in_range = leading_numbers(version)[:3] <= versions.ADAPTER_SCHEMAS.verified_up_to
    has_dsa = bool(backend.behaviour("npu_dsa_ops"))
    for op, args in adapter_calls():
        answer = verdict(backend.impls[op], *args)
        dsa = op.startswith(("indexer", "sparse"))
        expect_served = in_range and (has_dsa or not dsa)
        assert (answer is True) == expect_served, (op, answer)
        if answer is not True:
            continue
        got, want = backend.impls[op].fn(*args), getattr(hal.reference, op)(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            if op.startswith("indexer"):
                assert torch.equal(a.sort(-1).values, b.sort(-1).values), op
            elif a is not None and a.dtype.is_floating_point:
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=op)
            elif a is not None:
                assert torch.equal(a, b), op
