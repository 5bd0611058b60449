"""The Ascend backend: probe reasons, capabilities per chip generation, and every adapter
run end to end against the torch_npu emulator (tests/emulators/ascend.py) on CPU tensors,
compared with glm5_hal.reference; calls outside the vendor constraints must be declined
with a reason (dispatch then moves on) and never reach the vendor op."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends import ascend as ascend_pkg
from glm5_hal.backends.ascend import AscendBackend, chips
from emulators.ascend import NpuEmulator

from conftest import seeded

EMU = "ascend_emu"


def as_plugin(backend) -> types.ModuleType:
    module = types.ModuleType("ascend_emulated_plugin")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def emulated(chip: str = "910B", **runtime_kwargs) -> AscendBackend:
    return AscendBackend(runtime=NpuEmulator(chip, **runtime_kwargs), name=EMU, device_type="cpu",
                         priority=1000)


@pytest.fixture
def npu(hal_state):
    """An emulated 910B backend registered at run time; yields its emulator."""
    backend = emulated("910B")
    hal_state(as_plugin(backend), EMU)
    assert backend.availability().available, backend.availability().reason
    return backend.runtime


def chosen(op, *args):
    return hal.explain(op, *args).chosen


def rejection(op, *args) -> str:
    e = hal.explain(op, *args)
    return dict(e.rejected).get(f"{EMU}.{op}", "")


# -- probe ---------------------------------------------------------------------------------------
def test_without_torch_npu_the_registered_backend_says_the_bridge_is_missing():
    row = next(r for r in hal.backends() if r.name == "ascend")
    assert (row.available, row.reason, row.device_type) == (False, "bridge torch_npu not installed", "npu")
    assert "rms_norm" in row.ops


def fake_torch_npu(tmp_path, monkeypatch, body: str) -> None:
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)


def test_missing_cann_library_is_named_before_importing_the_bridge(tmp_path, monkeypatch):
    # the bridge would crash the test if imported: the library pre-check must answer first
    fake_torch_npu(tmp_path, monkeypatch, "raise SystemExit('imported torch_npu')\n")
    monkeypatch.setattr(chips, "CANN_LIBRARIES", ("libhccl_not_here_glm5.so",))
    availability = AscendBackend().availability()
    assert not availability.available
    assert availability.reason.startswith("runtime library missing: libhccl_not_here_glm5.so")
    assert "ASCEND_HOME_PATH" in availability.reason
    assert "torch_npu" not in sys.modules


def test_this_machine_has_no_libhccl():
    reason = ascend_pkg.missing_runtime_library(AscendBackend().vendor)
    assert reason is not None and reason.startswith("runtime library missing: libhccl.so")


def test_import_error_of_the_bridge_names_the_library(tmp_path, monkeypatch):
    fake_torch_npu(tmp_path, monkeypatch, "raise ImportError('libhccl.so: cannot open shared object file: "
                                          "No such file or directory')\n")
    monkeypatch.setattr(chips, "CANN_LIBRARIES", ("libc.so.6",))  # pre-check passes here
    reason = AscendBackend().availability().reason
    assert reason.startswith("runtime library missing: libhccl.so (torch_npu is installed")


@pytest.mark.parametrize("kwargs,expected", [
    ({"devices": 0}, "no NPU device visible (torch_npu.npu.device_count() == 0; check `npu-smi info` "
                     "and ASCEND_RT_VISIBLE_DEVICES)"),
    ({"version": "2.12.0"}, "torch_npu 2.12.0 is too old: the adapters use the torch_npu 2.13 op schemas"),
    ({"cann": "8.2.RC1"}, "CANN 8.2.RC1 is too old: the DSA kernels need CANN >= 8.3"),
    ({"cann": ""}, "the CANN version could not be read (''); the DSA kernels need CANN >= 8.3"),
    ({"chip": "310P"}, "unsupported chip Ascend310P3 (soc_version 202); the ascend backend supports "
                       "Atlas A2 (Ascend 910B): soc 220-225, Atlas A3 (Ascend 910C, 910_93xx): soc 250-256, "
                       "Ascend 950PR/950DT: soc 260"),
    ({"chip": "910A"}, "unsupported chip Ascend910A (soc_version 102)"),
])
def test_probe_gives_a_specific_reason(kwargs, expected):
    chip = kwargs.pop("chip", "910B")
    availability = emulated(chip, **kwargs).availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


@pytest.mark.parametrize("chip,generation,fp8", [
    ("910B", "Atlas A2 (Ascend 910B)", False),
    ("910B4", "Atlas A2 (Ascend 910B)", False),
    ("A3", "Atlas A3 (Ascend 910C, 910_93xx)", False),
    ("910_9362", "Atlas A3 (Ascend 910C, 910_93xx)", False),
    ("950", "Ascend 950PR/950DT", True),
    ("950DT", "Ascend 950PR/950DT", True),
])
def test_capabilities_per_generation(chip, generation, fp8):
    backend = emulated(chip)
    availability = backend.availability()
    emulator = backend.runtime
    assert availability.available
    assert availability.reason == (f"EMULATED (NpuEmulator): 8 x {emulator.device_name} ({generation}), "
                                   f"torch_npu 2.13.0, CANN 8.5.0")
    caps = backend.cached_capabilities()
    assert caps.dist_backend == "hccl" and caps.device_name == emulator.device_name
    assert caps.limits["generation"] == generation and caps.limits["fp8"] is fp8
    assert (torch.float8_e4m3fn in caps.dtypes) is fp8
    assert {torch.float32, torch.float16, torch.bfloat16} <= caps.dtypes
    assert backend.versions()["chip"] == f"{emulator.device_name} (soc {emulator.soc_version})"
    assert (backend.fp8_declined() is None) is fp8


def test_real_and_emulated_instances_keep_their_own_adapters():
    a, b = emulated("910B"), AscendBackend(runtime=NpuEmulator("950"), name="ascend_emu950", device_type="cpu")
    assert a.impls["rms_norm"].fn is not b.impls["rms_norm"].fn
    a.availability(), b.availability()
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    a.impls["rms_norm"].fn(x, w, 1e-6)
    assert (a.runtime.calls["npu_rms_norm"], b.runtime.calls["npu_rms_norm"]) == (1, 0)


def test_the_ascend_c_kernels_are_reported_as_not_built():
    backend = emulated()
    backend.availability()
    assert backend.cached_capabilities().limits["ascend_c_kernels"].startswith("Ascend C kernel not built")


# -- rms_norm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,dtype", [((3, 17), torch.float32), ((5,), torch.bfloat16),
                                         ((2, 3, 6144), torch.bfloat16), ((4, 6144), torch.float16),
                                         ((0, 8), torch.float32)])
def test_rms_norm_matches_the_reference(npu, shape, dtype):
    g = seeded(1)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"
    out = hal.ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, hal.reference.rms_norm(x, w, 1e-6))
    assert npu.calls["npu_rms_norm"] == (1 if x.numel() else 0)


def test_rms_norm_with_a_wider_weight_is_declined_for_half_inputs(npu):
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8)
    assert rejection("rms_norm", x, w, 1e-6).startswith("npu_rms_norm takes gamma in x's dtype")
    hal.ops.rms_norm(x, w, 1e-6)
    assert npu.calls["npu_rms_norm"] == 0
    x32 = torch.randn(2, 8)
    assert chosen("rms_norm", x32, w.to(torch.bfloat16), 1e-6) == f"{EMU}.rms_norm"
