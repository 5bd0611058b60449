"""No Ascend adapter makes the host wait for the device: every adapter runs through dispatch
on emulated device tensors (tests/no_sync.py) against the torch_npu emulator as device code,
with zero host reads per call -- except moe_permute's one read of its output size, which the
op's contract makes device data -- and gives the reference's answer."""
from __future__ import annotations

import types

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends.ascend import AscendBackend
from emulators.ascend import NpuEmulator

from conftest import seeded
from emulated_helpers import verdict
from no_sync import DEVICE_TYPE, device_runtime, on_device, to_device, to_host, watch

DEV = "ascend_dev"


class Kernels:
    """The Ascend C library (not buildable here) as device code: a Walsh-Hadamard butterfly."""

    def missing(self):
        return None

    def status(self):
        return "emulated"

    def hadamard(self, x, out, scale, stream):
        y, h = x.double(), 1
        while h < x.shape[1]:
            y = y.view(x.shape[0], -1, 2, h)
            y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
            h *= 2
        out.copy_((y.reshape(x.shape) * scale).to(out.dtype))


def on_emulated_device(hal_state, chip: str = "910B", **kwargs) -> AscendBackend:
    """An emulated Ascend backend whose tensors are device tensors, registered."""
    backend = AscendBackend(runtime=device_runtime(NpuEmulator(chip, cann=kwargs.pop("cann", "9.1.0"))), name=DEV,
                            device_type=DEVICE_TYPE, priority=1000, kernel_library=device_runtime(Kernels()), **kwargs)
    plugin = types.ModuleType("ascend_device_plugin")
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(plugin, DEV)
    assert backend.availability().available, backend.availability().reason
    return backend


@pytest.fixture
def npu(hal_state, monkeypatch):
    """An emulated 910B (CANN 9.1) on the emulated device; yields its emulator."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    return on_emulated_device(hal_state, vendor_precision=True).runtime.wrapped


def rnd(*shape, g, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def q8(*shape_and_g):
    *shape, g = shape_and_g
    return torch.randint(-127, 128, tuple(shape), generator=g, dtype=torch.int8)


def paged(context_lens, block_size, num_blocks, g):
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n in context_lens) + 1
    rows = [[free.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    return (torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32),
            torch.tensor(context_lens, dtype=torch.int32))


def calls():
    """One GLM-5-shaped call per adapter: (op, args, vendor op it must reach)."""
    g = seeded(50)
    table, lens = paged([40, 9, 0], 16, 8, g)
    w = (torch.randint(-127, 128, (3, 1, 32), generator=g).float() / 64)
    attn_idx = torch.randint(-2, 44, (3, 1, 16), generator=g, dtype=torch.int32)
    kv = rnd(8, 16, 576, g=g, scale=0.3)
    ids = torch.randint(-1, 9, (5, 4), generator=g, dtype=torch.int32)
    counts = torch.tensor([3, 0, 4, 2], dtype=torch.int32)
    return [
        ("rms_norm", (rnd(4, 6144, g=g), rnd(6144, g=g), 1e-6), "npu_rms_norm"),
        ("silu_and_mul", (rnd(4, 256, g=g),), "npu_swiglu"),
        ("apply_rope", (rnd(4, 8, 64, g=g), torch.tensor([0, 5, 17, 4095]), 1e6, True), "npu_rotary_mul"),
        ("indexer_topk_paged", (rnd(3, 1, 32, 128, g=g), rnd(8, 16, 128, g=g), w, table, lens, 2048),
         "npu_lightning_indexer"),
        ("sparse_mla_decode_paged", (rnd(3, 1, 16, 576, g=g, scale=0.3), kv, table, lens, attn_idx, 256 ** -0.5, 512),
         "npu_sparse_flash_attention"),
        ("sparse_mla_attention", (rnd(5, 16, 576, g=g, scale=0.3), kv[0], torch.randint(-1, 20, (5, 24), generator=g,
                                                                                         dtype=torch.int32),
                                  256 ** -0.5, 512), "npu_sparse_flash_attention"),
        ("moe_route", (rnd(5, 256, g=g), torch.randn(256, generator=g) * 0.1, 8, 1, 1, 2.5, True, "sigmoid"),
         "npu_moe_gating_top_k"),
        ("moe_unpermute", (rnd(13, 64, g=g), torch.randperm(20, generator=g)[:13].to(torch.int32),
                           torch.rand(5, 4, generator=g)), "npu_moe_finalize_routing"),
        ("grouped_gemm", (rnd(9, 64, g=g), rnd(4, 32, 64, g=g), counts), "npu_grouped_matmul"),
        ("grouped_gemm", (rnd(9, 64, g=g), rnd(1, 32, 64, g=g), torch.tensor([9], dtype=torch.int32)),
         "npu_grouped_matmul"),
        ("hadamard_transform", (rnd(4, 128, g=g), 128 ** -0.5), None),
        ("int8_quant", (rnd(5, 256, g=g, scale=2.0),), "npu_dynamic_quant"),
        ("int8_gemm", (q8(5, 256, g), torch.rand(5, generator=g), q8(48, 256, g), torch.rand(48, generator=g),
                       torch.bfloat16, None), "npu_quant_matmul"),
        ("int8_grouped_gemm", (q8(9, 128, g), torch.rand(9, generator=g), q8(4, 24, 128, g),
                               torch.rand(4, 24, generator=g), counts, torch.bfloat16), "npu_grouped_matmul"),
        ("moe_permute", (rnd(5, 64, g=g), ids, 8), "npu_moe_init_routing_v2"),
    ]


CALLS = calls()


@pytest.mark.parametrize("op,args,vendor_op", CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)])
def test_every_adapter_runs_without_reading_device_data(npu, op, args, vendor_op):
    device_args = to_device(args)
    with watch() as syncs:
        out = getattr(hal.ops, op)(*device_args)
    if op == "moe_permute":  # the contract sizes x_perm by device data: exactly that one read
        assert len(syncs) == 1 and syncs[0].kind == "scalar read" and "moe_permute" in syncs[0].frames[0], \
            syncs.report()
    else:
        assert not syncs, syncs.report()
    assert not hal.fallback_stats(), hal.fallback_stats()
    if vendor_op:
        assert npu.calls[vendor_op] == 1
    want = getattr(hal.reference, op)(*args)
    got = to_host(out)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if op == "indexer_topk_paged":  # every key taken: the same set
            assert torch.equal(a.sort(-1).values, b.sort(-1).values)
        elif a.dtype.is_floating_point:
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, equal_nan=True)
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("chip,dtype", [("910B", torch.bfloat16), ("950", torch.float8_e4m3fn)])
def test_kv_cache_write_runs_without_reading_device_data(hal_state, monkeypatch, chip, dtype):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    emulator = on_emulated_device(hal_state, chip).runtime.wrapped
    g = seeded(51)
    cache = torch.randn(4, 16, 576, generator=g).to(dtype)
    values = torch.randn(6, 576, generator=g).to(dtype)
    for slots in (torch.tensor([5, -1, 63, 0, -1, 17]), torch.full((6,), -1)):  # the second: padding only
        expected = cache.clone()
        hal.reference.kv_cache_write(expected, values, slots)
        with watch() as syncs:
            hal.ops.kv_cache_write(*to_device((cache, values, slots)))
        assert not syncs, syncs.report()
        assert torch.equal(cache.view(torch.int8), expected.view(torch.int8))
    assert emulator.calls["npu_scatter_nd_update_"] == 2 and not hal.fallback_stats()


def test_indexer_topk_reads_its_key_ranges_only_under_full_checks(npu, monkeypatch):
    """Its vendor batches come from per-token ranges: on a device the adapter declines rather
    than read them, and under GLM5_HAL_CHECKS=full (which reads device data anyway) it serves."""
    g = seeded(52)
    q, k = rnd(4, 32, 128, g=g), rnd(10, 128, g=g)
    w = torch.randint(-127, 128, (4, 32), generator=g).float() / 64
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.tensor([1, 2, 3, 10], dtype=torch.int32)
    args = to_device((q, k, w, ks, ke, 10))
    with watch() as syncs:
        why = verdict(hal.get_backend(DEV).impls["indexer_topk"], *args)
    assert not syncs, syncs.report()
    assert why.startswith("npu_lightning_indexer's TND batches come from the per-token key ranges read on the host")
    monkeypatch.setenv("GLM5_HAL_CHECKS", "full")
    hal.reload()
    with on_device():
        out = hal.ops.indexer_topk(*args)
    assert npu.calls["npu_lightning_indexer"] == 1
    assert torch.equal(to_host(out).sort(-1).values,
                       hal.reference.indexer_topk(q, k, w, ks, ke, 10).sort(-1).values)


def test_indexer_weights_in_q_dtype_are_checked_only_under_full_checks(hal_state, monkeypatch):
    """CANN 8.5 takes the indexer weights in q's dtype only: whether float32 weights survive the
    cast is a data check, so on a device the adapter declines without looking."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = on_emulated_device(hal_state, cann="8.5.0")
    args = CALLS[3][1]
    with watch() as syncs:
        answer = verdict(backend.impls["indexer_topk_paged"], *to_device(args))
    assert not syncs, syncs.report()
    assert answer.startswith("npu_lightning_indexer takes weights in q's dtype (bfloat16) here; whether these "
                             "float32 weights survive that cast is a data check")
