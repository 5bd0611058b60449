"""No device synchronisation in the musa, dcu, cambricon, kunlun, iluvatar and enflame adapters: every adapter,
through dispatch, on every conformance case (tiny preset) it serves, on emulated device
tensors (tests/no_sync.py), makes zero host reads per call.

The emulators play the device (`device_runtime`), and so do stand-ins of the backends' own
kernel libraries, which are not built here: the CUDA-dialect library (musa, dcu, iluvatar) is replaced
whole, so its launchers are not under test here; the cambricon / kunlun decode kernel keeps
glm5_hal's own launcher (glm5_hal.vendor_ops.dsa) and only its C entry point is device code.
Each call is made once before it is watched: one-time work (the dcu backend's torch._grouped_mm
self-check, cambricon's rope frequency constants) is outside the steady state.

One thing is not counted: the one scalar read of an op whose output size is the data
(moe_permute's row count, kv_cache_gather's total length).
"""
from __future__ import annotations

import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal import reference as ref
from glm5_hal.backends.cambricon import CambriconBackend
from glm5_hal.backends.dcu import DcuBackend
from glm5_hal.backends.enflame import EnflameBackend
from glm5_hal.backends.iluvatar import IluvatarBackend
from glm5_hal.backends._cuda_dialect import GpuKernelLibrary
from glm5_hal.backends.kunlun import KunlunBackend
from glm5_hal.backends.musa import MusaBackend
from glm5_hal.conformance import cases as conformance_cases
from glm5_hal.conformance.case import RESULT, RESULT_OR_ERROR, View
from emulators.cambricon import MluEmulator
from emulators.dcu import DcuEmulator
from emulators.enflame import GcuEmulator
from emulators.iluvatar import IluvatarEmulator
from emulators.kunlun import KvGatherKernelStandIn, XpuEmulator
from emulators.musa import MusaEmulator
from emulators.sparse_decode import SparseDecodeKernelStandIn
from no_sync import DEVICE_TYPE, device_runtime, on_device, to_device, watch

NAME = "nosync_emu"
#: ops whose output shape is the data: reading the size once is the op's contract
OUTPUT_SIZE_READS = {"moe_permute", "kv_cache_gather"}


class GpuKernelsStandIn:
    """The CUDA-dialect kernel library's launchers (musa, dcu), computed in torch: device code
    here, so the adapters around it are what is watched."""
    decode_limits = GpuKernelLibrary.decode_limits

    def missing(self):
        return None

    def status(self):
        return "stand-in (tests)"

    def silu_and_mul(self, x, stream):
        return ref.silu_and_mul(x)

    def kv_cache_write(self, cache, values, slot_mapping, stream):
        ref.kv_cache_write(cache, values, slot_mapping)

    def indexer_topk(self, q, keys, scale, weights, k_start, k_end, topk, stream):
        return ref.indexer_topk(q, keys if scale is None else (keys, scale), weights, k_start, k_end, topk)

    def indexer_topk_paged(self, q, keys, scale, weights, block_table, context_lens, topk, stream):
        cache = keys if scale is None else (keys, scale)
        return ref.indexer_topk_paged(q, cache, weights, block_table, context_lens, topk)

    def moe_permute(self, x, ids, num_experts, stream):
        return ref.moe_permute(x, ids, num_experts)

    def moe_unpermute(self, y, src, weights, stream):
        return ref.moe_unpermute(y, src, weights)

    def sparse_mla_decode_paged(self, q, kv_cache, block_table, context_lens, indices, sm_scale, d_v, stream):
        return ref.sparse_mla_decode_paged(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v)


class XpuKernelsStandIn(SparseDecodeKernelStandIn):
    """The kunlun library: the shared decode launcher over a stand-in entry point, and
    kv_cache_gather's launcher as device code."""

    def __init__(self):
        super().__init__()
        self.kv_cache_gather = device_runtime(KvGatherKernelStandIn()).kv_cache_gather


def decode_library(library):
    """`library` with only its C entry point (`launch`) as device code."""
    library.launch = device_runtime(library).launch
    return library


CONFIGS = {
    "musa S5000 mate 0.2.2": lambda: MusaBackend(runtime=device_runtime(MusaEmulator("S5000", mate="0.2.2")),
                                                 kernel_library=device_runtime(GpuKernelsStandIn()), **where()),
    "musa S5000 mate 0.2.0": lambda: MusaBackend(runtime=device_runtime(MusaEmulator("S5000", mate="0.2.0")),
                                                 kernel_library=device_runtime(GpuKernelsStandIn()), **where()),
    "musa S4000": lambda: MusaBackend(runtime=device_runtime(MusaEmulator("S4000")),
                                      kernel_library=device_runtime(GpuKernelsStandIn()), **where()),
    "dcu lightop 0.6": lambda: DcuBackend(runtime=device_runtime(DcuEmulator("K100_AI")),
                                          kernel_library=device_runtime(GpuKernelsStandIn()), **where()),
    # no kernels: the lightop paths (the indexer's per-row top-k) are the ones taken
    "dcu lightop 0.5": lambda: DcuBackend(runtime=device_runtime(DcuEmulator("K100_AI", lightop="0.5.3")),
                                          **where()),
    "cambricon MLU590": lambda: CambriconBackend(runtime=device_runtime(MluEmulator("MLU590")),
                                                 kernel_library=decode_library(SparseDecodeKernelStandIn()),
                                                 **where()),
    "cambricon cap6": lambda: CambriconBackend(runtime=device_runtime(MluEmulator("cap6")),
                                               kernel_library=decode_library(SparseDecodeKernelStandIn()), **where()),
    "iluvatar BI-V150": lambda: IluvatarBackend(runtime=device_runtime(IluvatarEmulator("BI-V150")),
                                                kernel_library=device_runtime(GpuKernelsStandIn()), **where()),
    # no kernels: the FlagGems top-k route of the indexer is the one taken
    "iluvatar BI-V150 no kernels": lambda: IluvatarBackend(runtime=device_runtime(IluvatarEmulator("BI-V150")),
                                                           **where()),
    "enflame gcu400": lambda: EnflameBackend(runtime=device_runtime(GcuEmulator("gcu400")), **where()),
    "kunlun P800": lambda: KunlunBackend(runtime=device_runtime(XpuEmulator("P800")),
                                         kernel_library=decode_library(XpuKernelsStandIn()), **where()),
}


#: what a configuration declines for every input (the chip lacks it): served by another one
DECLINED_EVERYWHERE = {
    "musa S4000": {"grouped_gemm", "fp8_block_gemm", "fp8_grouped_gemm"},    # mate's GEMMs: mp_31 only
    "dcu lightop 0.5": {"sparse_mla_attention", "sparse_mla_decode_paged", "kv_cache_write", "moe_permute",
                        "moe_unpermute"},                                     # kernel-only ops, no kernels
    "iluvatar BI-V150 no kernels": {"sparse_mla_attention", "sparse_mla_decode_paged", "kv_cache_write",
                                    "moe_permute", "moe_unpermute"},                      # kernel-only ops
    "cambricon MLU590": {"indexer_k_cache_write", "fp8_block_gemm", "fp8_grouped_gemm"},   # no FP8 declared
    "cambricon cap6": {"fp8_grouped_gemm"},              # per-block FP8 needs N % 128 == 0: no tiny case has it
}


def where() -> dict:
    return dict(name=NAME, device_type=DEVICE_TYPE, priority=1000)


def ops_of(config: str) -> list[str]:
    with_cases = set(conformance_cases.ops_with_cases())
    skip = DECLINED_EVERYWHERE.get(config, set())
    return sorted(op for op in CONFIGS[config]().impls if op in with_cases and op not in skip)


def register(backend, hal_state):
    plugin = types.ModuleType("nosync_emulated_plugin")
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(plugin, NAME)
    with on_device():
        assert backend.availability().available, backend.availability().reason
    return backend


def device_args(case) -> tuple:
    args = case.inputs(torch.Generator().manual_seed(7))
    return tuple(to_device(a.on(a.base) if isinstance(a, View) else a) for a in args)


def counted(syncs, op: str) -> list:
    """The syncs that count: all but the one output-size read of an op whose output size is the
    data."""
    left = list(syncs)
    if op in OUTPUT_SIZE_READS:
        size_reads = [s for s in left if s.kind == "scalar read" and s.frames and s.frames[0].endswith(f" in {op}")]
        if len(size_reads) == 1:
            left.remove(size_reads[0])
    return left


@pytest.mark.parametrize("config,op", [(c, op) for c in CONFIGS for op in ops_of(c)])
def test_every_served_call_reads_nothing_on_the_host(hal_state, config, op):
    backend = register(CONFIGS[config](), hal_state)
    served = 0
    for case in conformance_cases.cases(op, "tiny"):
        if case.outcome not in (RESULT, RESULT_OR_ERROR):
            continue
        args = device_args(case)
        with on_device(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if hal.explain(op, *args).chosen != f"{NAME}.{op}":
                continue
            try:
                getattr(hal.ops, op)(*args)       # once, unwatched: one-time work is not per call
            except hal.InvalidInputError:
                continue
        args = device_args(case)
        with watch() as syncs:
            getattr(hal.ops, op)(*args)
        assert not counted(syncs, op), f"{case.id}: {syncs.report()}"
        served += 1
    assert served, f"{config} served no tiny case of {op}"


def test_the_shared_moe_helpers_read_nothing_on_the_host():
    from glm5_hal.vendor_ops import moe
    ids = to_device(torch.tensor([[0, 3], [-1, 1]], dtype=torch.int32))
    with watch() as syncs:
        moe.sigmoid_underflow(to_device(torch.randn(2, 4)), "k")
        moe.spare_expert_ids(ids, 3)
        moe.repeated_slot(to_device(torch.tensor([0, 2, 1], dtype=torch.int32)), 4, "k")
        moe.permuted_in_contract_order(to_device(torch.randn(3, 2)), to_device(torch.tensor([1, 0, 2, 3],
                                       dtype=torch.int32)), to_device(torch.tensor([2, 1], dtype=torch.int32)))
    assert not syncs, syncs.report()
