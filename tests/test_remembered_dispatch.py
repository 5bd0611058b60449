"""One short path for every backend: a backend's metadata-only predicate (`supports_metadata`)
runs once per call key and its verdict is remembered with the implementation, so later calls
with the same metadata go from the public function straight to the kernel; a per-call
predicate (`supports`) and rejections (fallback accounting) still run on every call."""
from __future__ import annotations

import math
import sys
import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backend import Backend
from glm5_hal.registry import FallbackWarning

NAME = "remembered_vendor"


def vendor(hal_state, **predicates):
    """A cpu backend implementing rms_norm (the reference's math) with the given predicates,
    counting how often each runs; loaded, and pinned by the caller."""
    calls = {"kernel": 0, "metadata": 0, "per_call": 0}

    class Vendor(Backend):
        name, device_type = NAME, "cpu"

    backend = Vendor()

    def counted(kind, predicate):
        def run(x, weight, eps):
            calls[kind] += 1
            return predicate(x, weight, eps)
        return run

    kwargs = {("supports_metadata" if kind == "metadata" else "supports"): counted(kind, p)
              for kind, p in predicates.items()}

    @backend.impl("rms_norm", **kwargs)
    def rms_norm(x, weight, eps):
        calls["kernel"] += 1
        calls["frames"] = _frames_to(sys._getframe(), "test_")
        return hal.reference.rms_norm(x, weight, eps)

    plugin = types.ModuleType(NAME)
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(plugin, NAME)
    return calls


def _frames_to(frame, test_prefix: str) -> int:
    """Python frames from `frame` (counted) up to the test function (not counted)."""
    n = 0
    while frame is not None and not frame.f_code.co_name.startswith(test_prefix):
        n += 1
        frame = frame.f_back
    return n


def even_last_dim(x, weight, eps):
    return True if x.shape[-1] % 2 == 0 else "an odd last dim"


def test_a_metadata_predicate_runs_once_per_call_key(hal_state):
    calls = vendor(hal_state, metadata=even_last_dim)
    x, w = torch.randn(3, 8), torch.ones(8)
    with hal.use(NAME):
        for _ in range(5):
            torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), hal.reference.rms_norm(x, w, 1e-6))
        assert hal.explain("rms_norm", x, w, 1e-6).chosen == f"{NAME}.rms_norm"
        hal.ops.rms_norm(torch.randn(5, 8), w, 1e-6)   # new metadata: asked again
    assert calls["kernel"] == 6 and calls["metadata"] == 3   # two call keys, and explain's
    # the remembered path: the public function, then the implementation
    assert calls["frames"] <= 3


def test_a_declined_call_falls_back_and_is_counted_every_time(hal_state):
    calls = vendor(hal_state, metadata=even_last_dim)
    x, w = torch.randn(3, 7), torch.ones(7)
    with hal.use(NAME), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        for _ in range(3):
            torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), hal.reference.rms_norm(x, w, 1e-6))
    assert calls["kernel"] == 0
    assert hal.fallback_stats()[("rms_norm", NAME, "an odd last dim")] == 3


def test_a_per_call_predicate_runs_on_every_call(hal_state):
    calls = vendor(hal_state, metadata=even_last_dim, per_call=lambda x, weight, eps: True)
    x, w = torch.randn(3, 8), torch.ones(8)
    with hal.use(NAME):
        for _ in range(4):
            hal.ops.rms_norm(x, w, 1e-6)
    assert calls["kernel"] == 4 and calls["per_call"] == 4


def test_a_raising_metadata_predicate_declines(hal_state):
    def broken(x, weight, eps):
        raise RuntimeError("boom")
    calls = vendor(hal_state, metadata=broken)
    x, w = torch.randn(2, 4), torch.ones(4)
    with hal.use(NAME), pytest.warns(FallbackWarning, match="raised RuntimeError: boom"):
        hal.ops.rms_norm(x, w, 1e-6)
    assert calls["kernel"] == 0


def test_the_cpu_backend_is_served_from_the_remembered_call_key():
    op = hal.ops.rms_norm.op
    op.clear()
    x, w = torch.randn(3, 8), torch.ones(8)
    hal.ops.rms_norm(x, w, 1e-6)
    (hit,) = op._passed.values()
    assert hit[2] is hal.get_backend("cpu").impls["rms_norm"].fn


def test_the_fallback_warning_names_the_callers_line(hal_state):
    vendor(hal_state, metadata=even_last_dim)
    x, w = torch.randn(3, 5), torch.ones(5)
    with hal.use(NAME), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        line = sys._getframe().f_lineno + 1
        hal.ops.rms_norm(x, w, 1e-6)
    (warning,) = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_the_dispatch_bench_times_a_vendor_shaped_backend_both_ways():
    from glm5_hal.bench import dispatch
    rows = dispatch.measure(["rms_norm", "kv_cache_write"], repeats=1, min_time=0.001)
    for row in rows:
        assert math.isfinite(row["vendor_stub_overhead_us"]) and math.isfinite(row["per_call_supports_overhead_us"])
    text = dispatch.format_rows(rows)
    assert "vendor us" in text and "per-call supports us" in text
    assert dispatch.STUB not in {b.name for b in hal.backends()}


def test_the_fallback_warning_names_the_callers_line_through_torch_ops(hal_state):
    vendor(hal_state, metadata=even_last_dim)
    x, w = torch.randn(3, 5), torch.ones(5)
    with hal.use(NAME), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        line = sys._getframe().f_lineno + 1
        torch.ops.glm5_hal.rms_norm(x, w, 1e-6)
    (warning,) = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
