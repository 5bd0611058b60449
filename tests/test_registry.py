"""Dispatch rules: priority, declared dtypes, per-call supports, pinning, explain,
fallback accounting and strict mode -- with run-time plugins (the same registration path
entry-point plugins take; entry-point discovery itself is in test_plugins.py)."""
from __future__ import annotations

import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.registry import FallbackWarning


def as_plugin(hook) -> types.ModuleType:
    """A plugin module whose glm5_hal_register_backends hook is `hook(register)`."""
    module = types.ModuleType("test_plugin")
    module.glm5_hal_register_backends = hal.hookimpl(hook)
    return module


def make_plugin(name, *, device_type="cpu", priority=100, dtypes=(torch.float32,), supports=None,
                available=True, reason="test backend"):
    calls = []

    class _B(hal.Backend):
        def probe(self):
            return hal.Availability(available, reason)

    _B.name, _B.device_type, _B.priority = name, device_type, priority
    backend = _B()

    @backend.impl("rms_norm", dtypes=dtypes, supports=supports)
    def rms_norm(x, weight, eps):
        calls.append(x.shape)
        return hal.reference.rms_norm(x, weight, eps)

    return as_plugin(lambda register: register(backend)), backend, calls


def args(rows=2, dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, dim, generator=g).to(dtype), torch.randn(dim, generator=g), 1e-5


def test_cpu_backend_serves_rms_norm_by_default(hal_state):
    assert hal.explain("rms_norm", *args()).chosen == "cpu.rms_norm"


def test_higher_priority_backend_wins_for_its_dtype(hal_state):
    plugin, _, calls = make_plugin("fastcpu")
    hal_state(plugin, "fastcpu")
    out = hal.ops.rms_norm(*args())
    assert calls == [torch.Size([2, 8])]
    torch.testing.assert_close(out, hal.reference.rms_norm(*args()))
    e = hal.explain("rms_norm", *args(dtype=torch.bfloat16))
    assert e.chosen == "cpu.rms_norm"
    assert ("fastcpu.rms_norm", "implements rms_norm for {float32}, not bfloat16") in e.rejected


def test_supports_predicate_runs_per_call_with_its_reason(hal_state):
    plugin, _, calls = make_plugin("small", supports=lambda x, w, eps: x.shape[0] <= 4 or "more than 4 rows")
    hal_state(plugin, "small")
    hal.ops.rms_norm(*args(rows=3))
    hal.ops.rms_norm(*args(rows=9))
    hal.ops.rms_norm(*args(rows=4))
    assert [s[0] for s in calls] == [3, 4]
    e = hal.explain("rms_norm", *args(rows=9))
    assert e.chosen == "cpu.rms_norm" and e.rejected == (("small.rms_norm", "more than 4 rows"),)


def test_supports_that_raises_or_returns_junk_is_a_rejection(hal_state):
    def boom(*a):
        raise RuntimeError("kaput")
    plugin, _, calls = make_plugin("boomy", supports=boom)
    hal_state(plugin, "boomy")
    hal.ops.rms_norm(*args())
    assert calls == []
    assert "supports() raised RuntimeError: kaput" in str(hal.explain("rms_norm", *args()))


def test_unavailable_backend_is_skipped_with_its_probe_reason(hal_state):
    plugin, backend, calls = make_plugin("offline", available=False, reason="no device found")
    hal_state(plugin, "offline")
    hal.ops.rms_norm(*args())
    assert calls == []
    row = next(r for r in hal.backends() if r.name == "offline")
    assert (row.available, row.reason) == (False, "no device found")
    with pytest.raises(hal.BackendUnavailableError, match="no device found"):
        with hal.use("offline"):
            pass


def test_use_pins_a_backend_and_the_reference(hal_state):
    plugin, _, calls = make_plugin("pinme", priority=-5)
    hal_state(plugin, "pinme")
    assert hal.explain("rms_norm", *args()).chosen == "cpu.rms_norm"
    with hal.use("pinme"):
        assert hal.explain("rms_norm", *args()).chosen == "pinme.rms_norm"
        hal.ops.rms_norm(*args())
        with hal.use("reference"):
            assert hal.explain("rms_norm", *args()).chosen == "reference.rms_norm"
    assert len(calls) == 1
    assert hal.explain("rms_norm", *args()).chosen == "cpu.rms_norm"
    with pytest.raises(hal.BackendUnavailableError, match="no backend named 'nope'"):
        with hal.use("nope"):
            pass


def test_fallback_warns_once_per_reason_and_counts_every_call(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    plugin, _, _ = make_plugin("picky", supports=lambda x, w, eps: "never")
    hal_state(plugin, "picky")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            hal.ops.rms_norm(*args())
        hal.ops.rms_norm(*args(dtype=torch.float16))
    fallback_warnings = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallback_warnings) == 2, [str(w.message) for w in fallback_warnings]
    stats = hal.fallback_stats()
    assert stats[("rms_norm", "picky", "never")] == 3
    assert stats[("rms_norm", "picky", "implements rms_norm for {float32}, not float16")] == 1
    e = hal.explain("rms_norm", *args())
    assert e.chosen == "reference.rms_norm" and e.fallback


def test_strict_mode_turns_fallback_into_an_error(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    monkeypatch.setenv("GLM5_HAL_STRICT", "1")
    plugin, _, calls = make_plugin("strictly", supports=lambda x, w, eps: x.shape[0] < 3 or "too many rows")
    hal_state(plugin, "strictly")
    hal.ops.rms_norm(*args(rows=2))
    with pytest.raises(hal.UnsupportedOpError, match="too many rows"):
        hal.ops.rms_norm(*args(rows=5))
    with pytest.raises(hal.UnsupportedOpError, match="not bfloat16"):
        hal.ops.rms_norm(*args(dtype=torch.bfloat16))
    assert len(calls) == 1


def test_no_fallback_is_reported_when_no_device_backend_is_available(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    hal.reload()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        hal.ops.rms_norm(*args())
    assert hal.fallback_stats() == {}


def test_decisions_are_recomputed_after_a_plugin_loads(hal_state):
    assert hal.explain("rms_norm", *args()).chosen == "cpu.rms_norm"
    hal.ops.rms_norm(*args())
    plugin, _, calls = make_plugin("late")
    hal_state(plugin, "late")
    hal.ops.rms_norm(*args())
    assert len(calls) == 1


def test_faulty_plugins_are_quarantined_and_reported(hal_state):
    def hook_raises(register):
        raise RuntimeError("driver exploded")

    bad_hook = as_plugin(hook_raises)
    not_a_backend = as_plugin(lambda register: register(object()))
    _, dup_backend, _ = make_plugin("cpu")
    duplicate = as_plugin(lambda register: register(dup_backend))
    hal_state(bad_hook, "badhook")
    hal_state(not_a_backend, "notabackend")
    hal_state(duplicate, "dupname")
    rows = {r.name: r for r in hal.backends()}
    assert "driver exploded" in rows["badhook"].error
    assert "expects a glm5_hal.Backend instance, got object" in rows["notabackend"].error
    assert "backend name 'cpu' is already registered" in rows["dupname"].error
    assert all(not rows[n].available for n in ("badhook", "notabackend", "dupname"))
    assert hal.explain("rms_norm", *args()).chosen == "cpu.rms_norm"  # the HAL still works


def test_unknown_op_in_a_backend_quarantines_its_plugin(hal_state):
    class Odd(hal.Backend):
        name, device_type = "odd", "cpu"
    odd = Odd()
    odd.impl("rms_nrom")(lambda *a: None)
    plugin = as_plugin(lambda register: register(odd))
    hal_state(plugin, "odd")
    row = next(r for r in hal.backends() if r.name == "odd")
    assert "implements unknown ops ['rms_nrom']" in row.error


def test_strict_mode_makes_quarantine_fatal(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_STRICT", "1")
    plugin = as_plugin(lambda register: (_ for _ in ()).throw(RuntimeError("nope")))
    hal_state(plugin, "fatal")
    with pytest.raises(hal.PluginError, match="fatal: glm5_hal_register_backends raised: RuntimeError: nope"):
        hal.backends()


@pytest.mark.parametrize("var", ["GLM5_HAL_PLUGINS", "GLM5_HAL_DISABLE"])
def test_unknown_backend_names_in_settings_are_errors(hal_state, monkeypatch, var):
    monkeypatch.setenv(var, "cpu,nosuchbackend")
    hal.reload()
    with pytest.raises(hal.PluginError, match=r"unknown backends \['nosuchbackend'\]"):
        hal.ops.rms_norm(*args())


def test_reference_cannot_be_disabled(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "reference")
    hal.reload()
    with pytest.raises(hal.PluginError, match="'reference' cannot be disabled"):
        hal.backends()


def test_allowlist_keeps_only_named_backends_and_the_reference(hal_state, monkeypatch):
    plugin, _, calls = make_plugin("allowed")
    monkeypatch.setenv("GLM5_HAL_PLUGINS", "allowed")
    hal_state(plugin, "allowed")
    assert {r.name for r in hal.backends()} == {"reference", "allowed"}
    hal.ops.rms_norm(*args())
    assert calls and hal.explain("rms_norm", *args(dtype=torch.float16)).chosen == "reference.rms_norm"


def test_probe_that_raises_is_reported_not_propagated(hal_state):
    class Flaky(hal.Backend):
        name, device_type = "flaky", "cpu"

        def probe(self):
            raise OSError("libvendor.so: cannot open shared object file")
    flaky = Flaky()
    plugin = as_plugin(lambda register: register(flaky))
    hal_state(plugin, "flaky")
    row = next(r for r in hal.backends() if r.name == "flaky")
    assert not row.available and "probe raised OSError: libvendor.so" in row.reason


def test_capabilities_exclude_dtypes_the_device_lacks(hal_state):
    class NoBf16(hal.Backend):
        name, device_type, priority = "nobf16", "cpu", 100

        def capabilities(self):
            return hal.Capabilities(dtypes=frozenset({torch.float32, torch.float16}), device_name="OldChip")
    nb = NoBf16()
    nb.impl("rms_norm")(hal.reference.rms_norm)
    plugin = as_plugin(lambda register: register(nb))
    hal_state(plugin, "nobf16")
    assert hal.explain("rms_norm", *args(dtype=torch.float16)).chosen == "nobf16.rms_norm"
    e = hal.explain("rms_norm", *args(dtype=torch.bfloat16))
    assert e.chosen == "cpu.rms_norm"
    assert any("device OldChip does not support bfloat16" in why for _, why in e.rejected)


def test_explain_reports_invalid_input_instead_of_raising(hal_state):
    x, w, eps = args()
    e = hal.explain("rms_norm", x, w[:3], eps)
    assert e.chosen is None and "argument 'weight'" in e.error
    with pytest.raises(hal.UnsupportedOpError, match="unknown op 'rms_nrom'"):
        hal.explain("rms_nrom", x, w, eps)


def test_a_kernel_that_validates_values_rejects_on_the_first_call_too(hal_state):
    """The native value checks are the ones that reject, whether or not the decision is
    cached yet (the Python value checks never run before such a kernel)."""
    cache, values = torch.zeros(2, 4, 8), torch.randn(1, 8)
    bad = torch.tensor([99], dtype=torch.int32)
    for _ in range(2):   # the first call makes the decision, the second takes the cached one
        with pytest.raises(hal.InvalidInputError) as info:
            hal.ops.kv_cache_write(cache, values, bad)
        assert info.value.backend == "cpu" and info.value.arg == "slot_mapping"
    with hal.use("reference"):   # the reference does not validate: the op's value checks do
        with pytest.raises(hal.InvalidInputError) as info:
            hal.ops.kv_cache_write(cache, values, bad)
        assert info.value.backend is None and info.value.arg == "slot_mapping"
    assert not cache.any()
