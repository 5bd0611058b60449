"""The no-sync harness itself (tests/no_sync.py): every kind of host read is recorded with
the frame that did it, device code (a wrapped runtime) reads freely, results and in-place
writes come back as device tensors, and dispatch keyed on the emulated device skips the ops'
value checks outside GLM5_HAL_CHECKS=full."""
from __future__ import annotations

import types

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backend import Availability, Backend

from no_sync import DEVICE, DEVICE_TYPE, DeviceTensor, device_runtime, on_device, to_device, to_host, watch


def kinds_of(fn) -> list[str]:
    x = to_device(torch.tensor([3.0, 0.0, -1.0, 2.0]))
    with watch() as syncs:
        fn(x)
    return syncs.kinds()


@pytest.mark.parametrize("read,kind", [
    (lambda x: x.sum().item(), "scalar read"),
    (lambda x: bool(x.max() > 0), "scalar read"),
    (lambda x: int(x[0]), "scalar read"),
    (lambda x: float(x[1]), "scalar read"),
    (lambda x: torch.arange(4)[: x.argmax()], "scalar read"),
    (lambda x: x.tolist(), "scalar read"),
    (lambda x: x.numpy(), "scalar read"),
    (lambda x: f"{x}", "scalar read"),
    (lambda x: torch.equal(x, x), "scalar read"),
    (lambda x: x[x.argmax()], "scalar read"),          # a 0-dim index is read as a Python int
    (lambda x: x.cpu(), "copy to the host"),
    (lambda x: x.to("cpu"), "copy to the host"),
    (lambda x: torch.empty(4).copy_(x), "copy to the host"),
    (lambda x: x.nonzero(), "data-dependent shape"),
    (lambda x: torch.where(x > 0), "data-dependent shape"),
    (lambda x: x[x > 0], "data-dependent shape"),
    (lambda x: x.masked_select(x > 0), "data-dependent shape"),
    (lambda x: x.unique(), "data-dependent shape"),
    (lambda x: torch.bincount(x.long().clamp(min=0)), "data-dependent shape"),
    (lambda x: torch.repeat_interleave(x, x.long().clamp(min=0)), "data-dependent shape"),
    (lambda x: torch.tensor([1, 2], device=DEVICE), "blocking host-to-device copy"),
    (lambda x: torch.arange(3).to(x.device), "blocking host-to-device copy"),
    (lambda x: x[:2].copy_(torch.ones(2)), "blocking host-to-device copy"),
    (lambda x: x + torch.ones(4), "host tensor in a device op"),
    (lambda x: x[torch.tensor([0, 2])], "host tensor in a device op"),
])
def test_every_kind_of_host_read_is_recorded(read, kind):
    assert kind in kinds_of(read)


@pytest.mark.parametrize("fine", [
    lambda x: (x * 2 + 1).sum(),
    lambda x: torch.where(x > 0, x, 0.0).cumsum(0),
    lambda x: torch.full((3,), -1, dtype=torch.int32, device=x.device),
    lambda x: torch.arange(5, device=x.device) * x.shape[0],
    lambda x: x.sort(stable=True).indices.topk(2).values,
    lambda x: torch.repeat_interleave(x, x.long().clamp(min=0), output_size=5),
    lambda x: x.nonzero_static(size=4),
    lambda x: x + torch.tensor(2.0),                    # a host scalar is an argument, not data
    lambda x: x[x.argmax().view(1)],                     # indexing with a device index tensor
    lambda x: x.masked_fill(x < 0, 0.0).to(torch.bfloat16),
    lambda x: x.shape[0] + x.numel() + x.stride(0),     # metadata
])
def test_device_side_work_is_not_a_sync(fine):
    assert kinds_of(fine) == []


def test_results_are_device_tensors_and_writes_land_in_the_original():
    host = torch.zeros(4)
    x = to_device(host)
    with watch() as syncs:
        y = x + 1
        x[1:3] = y[1:3] * 5
        z = torch.full((2,), 7.0, device=DEVICE)
    assert not syncs, syncs.report()
    assert isinstance(y, DeviceTensor) and y.device == DEVICE and isinstance(z, DeviceTensor)
    assert host.tolist() == [0.0, 5.0, 5.0, 0.0]
    assert torch.equal(to_host(z), torch.full((2,), 7.0))


def test_the_frame_that_read_is_named():
    x = to_device(torch.ones(2))
    with watch() as syncs:
        x.sum().item()
    assert len(syncs) == 1 and syncs[0].frames[0].startswith("test_no_sync.py:")
    assert "scalar read" in syncs.report() and "test_the_frame_that_read_is_named" in syncs.report()


class Emulator:
    """A stand-in vendor runtime: reads its inputs on the host, writes in place."""
    EMULATOR = True
    __version__ = "1.0"

    def __init__(self):
        self.npu = types.SimpleNamespace(device_count=lambda: 1)

    def count_positive(self, x):
        assert not isinstance(x, DeviceTensor)
        return torch.tensor([int((x > 0).sum())]), x.tolist()

    def fill_(self, target, value):
        target.fill_(float(value.max()))
        return target


def test_device_code_reads_freely_and_returns_device_tensors():
    runtime = device_runtime(Emulator())
    x = to_device(torch.tensor([1.0, -2.0, 3.0]))
    with watch() as syncs:
        counts, values = runtime.count_positive(x)
        out = runtime.fill_(x, x.abs())
    assert not syncs, syncs.report()
    assert isinstance(counts, DeviceTensor) and to_host(counts).tolist() == [2] and values == [1.0, -2.0, 3.0]
    assert out is x and to_host(x).tolist() == [3.0, 3.0, 3.0]
    assert runtime.EMULATOR is True and runtime.__version__ == "1.0" and runtime.npu.device_count() == 1


def test_device_side_asserts_are_evaluated_not_synced():
    x = to_device(torch.tensor([1, 2, 3]))
    with watch() as syncs:
        torch._assert_async((x >= 0).all(), "negative index")
        with pytest.raises(RuntimeError, match="device-side assertion failed: out of range"):
            torch._assert_async((x < 3).all(), "out of range")
    assert not syncs


def test_outside_watch_device_tensors_are_plain_tensors():
    x = to_device(torch.tensor([1.0, 2.0]))
    assert (x * 2).tolist() == [2.0, 4.0] and bool((x > 0).all())
    with on_device():
        assert torch.zeros(2, device=DEVICE).device == DEVICE


class Probe(Backend):
    name, device_type, priority = "no_sync_probe", DEVICE_TYPE, 100

    def probe(self):
        return Availability(True, "emulated device")


def test_dispatch_on_the_emulated_device_reads_no_values(hal_state, monkeypatch):
    """kv_cache_write has value checks (slot range, repeated slots): on a device they run only
    under GLM5_HAL_CHECKS=full, so a default call reads nothing; under full they read."""
    backend = Probe()

    @backend.impl("kv_cache_write")
    def kv_cache_write(cache, values, slot_mapping):
        cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping.clamp(min=0), values)

    plugin = types.ModuleType("no_sync_probe_plugin")
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(plugin, backend.name)
    cache, values = to_device(torch.zeros(4, 3)), to_device(torch.ones(2, 3))
    slots = to_device(torch.tensor([1, 2]))
    with watch() as syncs:
        hal.ops.kv_cache_write(cache.view(2, 2, 3), values, slots)
    assert not syncs, syncs.report()
    assert to_host(cache)[1:3].eq(1).all()
    monkeypatch.setenv("GLM5_HAL_CHECKS", "full")
    hal.reload()
    with watch() as syncs:
        hal.ops.kv_cache_write(cache.view(2, 2, 3), values, slots)
    assert syncs, "the full value checks read the slots"
