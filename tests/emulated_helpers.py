"""Shared by the tests that run a vendor backend against its CPU emulator (tests/test_cuda_backend.py,
test_dcu.py, test_iluvatar.py, test_enflame.py): registering the emulated backend at run time as a
vendor machine would see it, what dispatch chose, why the backend declined (and an implementation's
predicates' verdict, what dispatch remembers with a call key), and seeded inputs."""
from __future__ import annotations

import math
import types
import warnings

import torch

import glm5_hal as hal


def as_plugin(backend) -> types.ModuleType:
    """A run-time plugin module whose hook registers `backend`."""
    module = types.ModuleType(f"{backend.name}_plugin")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def register_emulated(hal_state, monkeypatch, backend):
    """Registers `backend` at run time, under its name, with the cpu backend disabled: as on the
    vendor's device (where the cpu backend cannot take its tensors), a declined call runs the
    reference. The emulated backend must be available."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    hal_state(as_plugin(backend), backend.name)
    assert backend.availability().available, backend.availability().reason
    return backend


def chosen(op, *args) -> str:
    """The implementation dispatch picks for op(*args), as "backend.op"."""
    return hal.explain(op, *args).chosen


def declined_reason(backend_name: str, op, *args) -> str:
    """Why backend `backend_name` declined op(*args); "" when it did not."""
    return dict(hal.explain(op, *args).rejected).get(f"{backend_name}.{op}", "")


def verdict(impl, *args):
    """An implementation's verdict on a call as dispatch reaches it: its `supports_metadata`,
    then its per-call `supports` (True, or the first reason)."""
    for predicate in (impl.supports_metadata, impl.supports):
        if predicate is not None:
            answer = predicate(*args)
            if answer is not True:
                return answer
    return True


def remembered(public, *args):
    """What dispatch remembers with the call key of `public(*args)` (a glm5_hal.ops function),
    from a first call after forgetting every decision: the implementation every later call with
    that key goes straight to (a `supports_metadata` predicate accepted it once), or None where
    each call runs a per-call `supports` predicate."""
    op = public.op
    op.clear()
    public(*args)
    (hit,) = op._passed.values()
    return hit[2]


def same_call_key(public) -> bool:
    """Whether every call of `public` since `remembered` had one call key."""
    return len(public.op._passed) == 1


def assert_page_view_write_declined_per_call(shape, values, slots, vendor_calls) -> None:
    """A vendor kv_cache_write whose predicate reads the cache's contiguity (which the call key
    does not hold, only whether the cache is paged) is not remembered: it serves a contiguous
    cache of `shape` (one vendor call, `vendor_calls()` counts them) and declines, per call, a
    block-strided page view with the same call key, which the reference then writes."""
    expected = torch.zeros(shape)
    hal.reference.kv_cache_write(expected, values, slots)
    write = hal.ops.kv_cache_write
    cache = torch.zeros(shape)
    assert remembered(write, cache, values, slots) is None and torch.equal(cache, expected)
    assert vendor_calls() == 1
    blocks, rows = shape[0], math.prod(shape[1:])
    page_view = torch.zeros(blocks, rows + 8)[:, :rows].view(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hal.FallbackWarning)
        write(page_view, values, slots)
    assert same_call_key(write) and vendor_calls() == 1
    assert torch.equal(page_view, expected)


def randn(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)
