"""Vendor identification and the VendorBackend base: probing never raises and says why."""
from __future__ import annotations

import re

import sys
import types

import pytest

import glm5_hal as hal
from glm5_hal import vendor_backend, vendors
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


@pytest.mark.parametrize("name", ["ascend", "musa", "dcu", "cambricon", "kunlun"])
def test_every_fact_of_a_vendor_names_its_public_source_or_is_unconfirmed(name):
    """Each field of these vendors' records names a public source (repository, path, tag or
    commit) in vendors.SOURCES, or is listed as unconfirmed; never both."""
    vendor, sources = vendors.VENDORS[name], vendors.SOURCES[name]
    facts = {"bridge", "device_type", "dist_backend", "toolchain_env", "compiler", "smi", "visible_devices"}
    assert set(sources) | set(vendor.unconfirmed) >= facts
    assert not set(sources) & set(vendor.unconfirmed) - {"bridge"}   # kunlun: sourced for v0.10.1.1 only
    assert all(re.search(r"@[0-9a-f]{7,}|\(?[0-9a-f]{7,8}\)|v\d+\.\d+|\d+\.\d+\.\d+ wheel", text) for text in sources.values()), sources


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


class HookedAscend(VendorBackend):
    """A vendor backend made of hooks only: the probe skeleton of VendorBackend runs them."""
    vendor_name = "ascend"
    device_noun = "NPU device"
    device_count_call = "npu.device_count()"

    def check_versions(self, runtime):
        return {"bridge": vendor_backend.require_version("bridge", vendor_backend.module_version(runtime), (2, 13),
                                                         "the adapters need 2.13")}

    def devices(self, runtime):
        return runtime.npu

    def identify_chip(self, runtime, count, versions):
        name = runtime.npu.get_device_name()
        if name == "old":
            raise vendor_backend.Declined("unsupported chip old")
        return vendor_backend.ChipInfo(name, count, f"{count} x {name}", identity="soc 1", versions=versions)

    def chip_dtypes(self, chip):
        return vendor_backend.device_dtypes()


def hooked_runtime(count=1, name="new", version="2.13.0"):
    def fail(what):
        raise RuntimeError(f"driver said no to {what}")
    npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=(lambda: count) if count is not None else (lambda: fail("device_count")),
        get_device_name=(lambda: name) if name is not None else (lambda: fail("get_device_name")))
    return types.SimpleNamespace(npu=npu, __version__=version)


@pytest.mark.parametrize("runtime,reason", [
    (hooked_runtime(version="2.12.1"), "bridge 2.12.1 is too old: the adapters need 2.13"),
    (hooked_runtime(version="dev"), "the bridge version could not be read ('dev'); the adapters need 2.13"),
    (hooked_runtime(version=""), "bridge (no __version__) is too old: the adapters need 2.13"),
    (hooked_runtime(count=None), "querying NPU devices failed: RuntimeError: driver said no to device_count"),
    (hooked_runtime(count=0), "no NPU device visible (npu.device_count() == 0; check `npu-smi` and "
                              "ASCEND_RT_VISIBLE_DEVICES)"),
    (hooked_runtime(name=None), "reading the NPU device identity failed: RuntimeError: driver said no to "
                                "get_device_name"),
    (hooked_runtime(name="old"), "unsupported chip old"),
])
def test_the_probe_skeleton_stops_at_the_first_failing_step(runtime, reason):
    backend = HookedAscend(runtime=runtime)
    assert backend.availability() == hal.Availability(False, reason)
    assert backend.chip is None and backend.capabilities() == hal.Capabilities(dist_backend="hccl")


def test_what_the_probe_found_is_reported():
    backend = HookedAscend(runtime=hooked_runtime(count=4))
    assert backend.availability() == hal.Availability(True, "4 x new")
    assert backend.versions() == {"torch_npu": "2.13.0", "bridge": "2.13.0", "chip": "new (soc 1)"}
    caps = backend.cached_capabilities()
    assert (caps.device_name, caps.dist_backend, caps.limits) == ("new", "hccl", {"devices": 4})


# -- versioned behaviours ---------------------------------------------------------------------
def test_a_behaviour_is_chosen_by_the_installed_version():
    from glm5_hal.vendor_backend import Behaviour, Era
    lse = Behaviour("lse_base", "mate", (Era((0, 2, 0), 2.0, "mate v0.2.0 a.py"),
                                        Era((0, 2, 1), "e", "mate v0.2.1 a.py")), verified_up_to=(0, 2, 1))
    assert lse.resolve("0.2.0") == (2.0, None)
    assert lse.resolve("0.2.1+musa4.3") == ("e", None)
    assert lse.resolve("0.2") == (2.0, None)
    value, why = lse.resolve("0.3.0")
    assert value is None and "newer than 0.2.1" in why
    value, why = lse.resolve("0.1.9")
    assert value is None and "older than 0.2.0" in why
    assert lse.resolve(None) == (None, "mate is not installed")
    assert "could not be read" in lse.resolve("dev")[1]


def test_post_releases_order_after_their_release():
    """torch_npu ships schema changes in post releases (2.7.1.post2 has ops 2.7.1 lacks)."""
    from glm5_hal.vendor_backend import Behaviour, Era, leading_numbers
    assert leading_numbers("2.7.1.post2") == (2, 7, 1, 2) > leading_numbers("2.7.1") == (2, 7, 1)
    assert leading_numbers("2.7.1.post11+cpu") == (2, 7, 1, 11)
    assert leading_numbers("2.13.0+cpu") == (2, 13, 0) and leading_numbers("8.5.RC1") == (8, 5)
    ops = Behaviour("ops", "torch_npu", (Era((2, 7, 1), False, "2.7.1"), Era((2, 7, 1, 2), True, "2.7.1.post2"),
                                         Era((2, 8, 0), False, "2.8.0")), verified_up_to=(2, 8, 0))
    assert [ops.resolve(v)[0] for v in ("2.7.1", "2.7.1.post1", "2.7.1.post2", "2.7.1.post11", "2.8.0.post3")] == [
        False, False, True, True, False]
