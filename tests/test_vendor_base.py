"""Vendor identification and the VendorBackend base: probing never raises and says why."""
from __future__ import annotations

import sys
import types

import pytest

import glm5_hal as hal
from glm5_hal import vendors
from glm5_hal.vendor_backend import VendorBackend, import_bridge


def fake_torch(**attrs):
    t = types.SimpleNamespace(__version__="2.13.0", version=types.SimpleNamespace(cuda=None, hip=None))
    for k, v in attrs.items():
        setattr(t, k, v)
    return t


@pytest.mark.parametrize("attrs,expected", [
    ({}, "none"),
    ({"version": types.SimpleNamespace(cuda="12.8", hip=None)}, "cuda"),
    ({"version": types.SimpleNamespace(cuda=None, hip="6.2")}, "rocm"),
    ({"version": types.SimpleNamespace(cuda=None, hip="6.2"), "__hcu_version__": "2.9.0+das.dtk2604"}, "dcu"),
    ({"version": types.SimpleNamespace(cuda="10.2", hip=None), "corex": True}, "iluvatar"),
    ({"__version__": "2.1.0+corex.4.2.0", "version": types.SimpleNamespace(cuda="10.2", hip=None)}, "iluvatar"),
])
def test_cuda_flavor_tells_masquerading_stacks_apart(attrs, expected):
    assert vendors.cuda_flavor(fake_torch(**attrs)) == expected


def test_identify_prefers_vendor_attributes_over_cuda():
    cuda = types.SimpleNamespace(cuda="12.1", hip=None)
    assert vendors.identify(fake_torch(version=cuda, musa=object())) == "musa"
    assert vendors.identify(fake_torch(version=cuda, mlu=object())) == "cambricon"
    assert vendors.identify(fake_torch(version=cuda, npu=object())) == "ascend"
    assert vendors.identify(fake_torch(version=cuda)) == "cuda"
    assert vendors.identify(fake_torch()) is None


def test_every_vendor_fact_is_complete():
    for v in vendors.VENDORS.values():
        assert v.device_type and v.dist_backend and v.smi and v.visible_devices and v.toolchain_env
        assert set(v.unconfirmed) <= {f.name for f in vendors.dataclasses.fields(v)}


class FakeAscend(VendorBackend):
    vendor_name = "ascend"

    def probe_runtime(self, runtime):
        n = runtime.npu.device_count()
        return hal.Availability(n > 0, f"{n} NPU(s)" if n else "no NPU device found")


def test_bridge_not_installed_is_a_reason_not_an_error():
    assert not vendors.installed("torch_npu")
    b = FakeAscend()
    assert b.availability() == hal.Availability(False, "bridge torch_npu not installed")


def test_missing_runtime_library_is_named(tmp_path, monkeypatch):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    b = FakeAscend()
    reason = b.availability().reason
    assert not b.availability().available
    assert reason.startswith("runtime library missing: libhccl.so")
    assert "ASCEND_HOME_PATH" in reason


def test_a_bridge_that_exits_at_import_is_contained(tmp_path, monkeypatch):
    (tmp_path / "torch_mlu.py").write_text("import sys; sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_mlu", raising=False)
    module, reason = import_bridge(vendors.VENDORS["cambricon"])
    assert module is None and reason == "importing torch_mlu failed: SystemExit: 3"


def test_injected_runtime_and_emulator_label():
    real_like = types.SimpleNamespace(npu=types.SimpleNamespace(device_count=lambda: 0), __version__="2.13.0")
    assert FakeAscend(runtime=real_like).availability() == hal.Availability(False, "no NPU device found")

    class NpuEmulator:
        EMULATOR = True
        npu = types.SimpleNamespace(device_count=lambda: 2)
    b = FakeAscend(runtime=NpuEmulator(), name="ascend_emu", device_type="cpu", priority=5)
    assert (b.name, b.device_type, b.priority) == ("ascend_emu", "cpu", 5)
    assert b.availability().reason == "EMULATED (NpuEmulator): 2 NPU(s)"
    assert b.versions() == {"runtime": "emulator NpuEmulator"}
