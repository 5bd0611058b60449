"""The Enflame GCU backend: probe reasons (torch_gcu and torch.gcu as vllm-gcu's platform reads
them), generations by capability, vllm-gcu's op schemas chosen by its version, and every adapter
run end to end against the GCU emulator (tests/emulators/enflame.py) on CPU tensors, compared with
glm5_hal.reference; declined calls name the reason and never reach the vendor op."""
from __future__ import annotations

import functools
import sys
import types

import pytest
import torch

import glm5_hal as hal
from glm5_hal import vendors
from glm5_hal.backends.enflame import EnflameBackend
from glm5_hal.backends.enflame.runtime import load_ops
from emulators.enflame import GcuEmulator

from conftest import seeded
from emulated_helpers import (assert_page_view_write_declined_per_call, chosen, declined_reason, randn,
                              register_emulated, remembered, verdict)

EMU = "enflame_emu"
F32, F16, BF16, I32, I64 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64
FLOATS = (F32, F16, BF16)
rejection = functools.partial(declined_reason, EMU)


def emulated(chip: str = "gcu400", **runtime_kwargs) -> EnflameBackend:
    return EnflameBackend(runtime=GcuEmulator(chip, **runtime_kwargs), name=EMU, device_type="cpu", priority=1000)


def register(hal_state, monkeypatch, chip: str = "gcu400", **runtime_kwargs) -> EnflameBackend:
    return register_emulated(hal_state, monkeypatch, emulated(chip, **runtime_kwargs))


@pytest.fixture
def gcu(hal_state, monkeypatch) -> EnflameBackend:
    return register(hal_state, monkeypatch)


# -- probe -----------------------------------------------------------------------------------------------
def test_on_this_machine_the_registered_backend_says_torch_gcu_is_missing():
    row = next(r for r in hal.backends() if r.name == "enflame")
    assert (row.available, row.device_type, row.reason) == (False, "gcu", "bridge torch_gcu not installed")
    assert set(row.ops) == {"rms_norm", "silu_and_mul", "apply_rope", "int8_quant", "kv_cache_write",
                            "fp8_block_gemm", "moe_route"}


@pytest.mark.parametrize("kwargs,expected", [
    ({"gcu_attribute": False}, "torch_gcu imported but did not register the gcu device (torch.gcu is missing); is this "
                               "torch_gcu built for this torch?"),
    ({"version": "2.6.0+3.4.1"}, "torch_gcu 2.6.0+3.4.1 is too old: vllm-gcu's ops need torch_gcu 2.7 (PyTorch 2.7)"),
    ({"devices": 0}, "no GCU visible (torch.gcu.device_count() == 0; check `efsmi` and TOPS_VISIBLE_DEVICES)"),
])
def test_probe_gives_a_specific_reason(kwargs, expected):
    availability = emulated(**kwargs).availability()
    assert not availability.available and availability.reason == expected


def test_an_unknown_generation_is_declined():
    availability = emulated("gcu200").availability()
    assert availability.reason == ("unsupported GCU generation (torch.gcu capability 2.0, Enflame T20); the enflame "
                                   "backend supports gcu300 (capability 3.x), gcu400 (capability 4.x)")


@pytest.mark.parametrize("chip,dtypes", [("gcu300", {F32, F16, BF16}),
                                         ("gcu400", {F32, F16, BF16, torch.float8_e4m3fn})])
def test_capabilities_per_generation(chip, dtypes):
    backend = emulated(chip)
    assert backend.availability().reason.startswith(
        f"EMULATED (GcuEmulator): 8 x {GcuEmulator(chip).gcu.get_device_name()} ({chip}), torch_gcu 2.7.0+3.5.0, "
        "vllm_gcu 0.9.2+3.6")
    caps = backend.cached_capabilities()
    assert (set(caps.dtypes), caps.dist_backend) == (dtypes, "eccl")
    assert caps.limits["arch"] == chip and caps.limits["fp8"] == (chip == "gcu400")
    assert backend.versions()["chip"].endswith(f"(capability {GcuEmulator(chip).gcu.get_device_capability()[0]}.0)")


def test_a_torch_whose_cuda_answers_for_gcus_is_identified_as_enflame_before_any_cuda_flavor():
    patched = types.SimpleNamespace(gcu=types.SimpleNamespace(), version=types.SimpleNamespace(cuda="12.8", hip=None),
                                    __version__="2.7.0")
    assert vendors.identify(patched) == "enflame"


def test_without_vllm_gcu_every_adapter_declines_with_the_reason(hal_state, monkeypatch):
    register(hal_state, monkeypatch, vllm_gcu=None)
    assert rejection("silu_and_mul", torch.ones(2, 8)) == (
        "vllm_gcu not installed (vllm-gcu's ops: EnflameTechnology/vllm-gcu)")


def test_the_real_runtime_says_vllm_gcu_is_missing():
    assert load_ops(torch) == (None, "vllm_gcu not installed (vllm-gcu's ops: EnflameTechnology/vllm-gcu)")


def test_a_vllm_gcu_outside_the_read_range_narrows_the_backend(hal_state, monkeypatch):
    backend = register(hal_state, monkeypatch, vllm_gcu="0.10.1+3.7")
    assert "vllm_gcu 0.10.1+3.7 is newer than 0.9.2" in backend.availability().reason
    assert rejection("rms_norm", torch.ones(2, 8), torch.ones(8), 1e-6).startswith("vllm_gcu_ops unverified here")
    assert backend.runtime.calls["rms_norm"] == 0


def test_the_bridge_is_found_without_importing_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_gcu", None)   # importing it would raise
    assert EnflameBackend().availability().reason == "bridge torch_gcu not installed"


# -- adapters --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_matches_the_reference(gcu, dtype):
    g = seeded(1)
    x, w = randn(2, 3, 72, g=g, dtype=dtype), randn(72, g=g, dtype=dtype)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"
    torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), hal.reference.rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1e-5)
    assert gcu.runtime.calls["rms_norm"] == 1


def test_rms_norm_declines_a_weight_it_would_round(gcu):
    assert rejection("rms_norm", torch.ones(2, 8, dtype=BF16), torch.ones(8), 1e-6) == (
        "vLLM's rms_norm schema takes the weight in x's dtype; casting the float32 weight to bfloat16 would round it")


@pytest.mark.parametrize("dtype", FLOATS)
def test_silu_and_mul_matches_the_reference(gcu, dtype):
    x = randn(3, 5, 34, g=seeded(2), dtype=dtype)
    assert chosen("silu_and_mul", x) == f"{EMU}.silu_and_mul"
    torch.testing.assert_close(hal.ops.silu_and_mul(x), hal.reference.silu_and_mul(x), rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_apply_rope_matches_the_reference_in_both_pair_layouts(gcu, interleaved, dtype):
    g = seeded(3)
    x = randn(5, 3, 64, g=g, dtype=dtype)
    positions = torch.tensor([0, 7, 4095, 3, 100000])
    assert chosen("apply_rope", x, positions, 10000.0, interleaved) == f"{EMU}.apply_rope"
    torch.testing.assert_close(hal.ops.apply_rope(x, positions, 10000.0, interleaved),
                               hal.reference.apply_rope(x, positions, 10000.0, interleaved), rtol=1.6e-2, atol=1e-4)
    assert gcu.runtime.calls["rotary_embedding"] == 1


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_quant_matches_the_reference_including_a_row_of_zeros(gcu, dtype):
    x = randn(4, 40, g=seeded(4), dtype=dtype)
    x[2] = 0
    q, scale = hal.ops.int8_quant(x)
    ref_q, ref_scale = hal.reference.int8_quant(x)
    torch.testing.assert_close(scale, ref_scale)
    assert (q.int() - ref_q.int()).abs().max() <= 1 and not q[2].any()
    assert gcu.runtime.calls["dynamic_scaled_int8_quant"] == 1


def test_int8_quant_declines_a_row_whose_reciprocal_scale_overflows(gcu):
    x = torch.ones(2, 8)
    x[0] = 1e-38
    assert "overflows to inf and saturates every code" in rejection("int8_quant", x)
    assert gcu.runtime.calls["dynamic_scaled_int8_quant"] == 0


@pytest.mark.parametrize("dtype", [BF16, torch.float8_e4m3fn])
def test_kv_cache_write_matches_the_reference_and_skips_padded_slots(gcu, dtype):
    g = seeded(5)
    values = randn(4, 10, g=g).to(dtype)
    slots = torch.tensor([5, -1, 0, 11])
    cache = torch.zeros(3, 4, 10).to(dtype)
    expected = cache.clone()
    hal.reference.kv_cache_write(expected, values, slots)
    assert chosen("kv_cache_write", cache, values, slots) == f"{EMU}.kv_cache_write"
    hal.ops.kv_cache_write(cache, values, slots)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert gcu.runtime.calls["concat_and_cache_mla"] == 1


def test_kv_cache_write_declines_a_block_strided_page_view(gcu):
    # a serving engine's page view: each block's rows contiguous, the blocks 13 elements apart
    block_strided = torch.zeros(3, 13)[:, :8].view(3, 2, 4)
    assert not block_strided.is_contiguous()
    answer = verdict(gcu.impls["kv_cache_write"], block_strided, torch.ones(1, 4), torch.tensor([0]))
    assert answer == ("concat_and_cache_mla is called with contiguous caches by vllm-gcu; whether topsvllm honours a "
                      "block-strided page view is not public")


def test_kv_cache_write_declines_what_concat_and_cache_mla_cannot_write(gcu):
    slots = torch.tensor([0])
    assert rejection("kv_cache_write", torch.zeros(2, 2, 1), torch.ones(1, 1), slots) == (
        "concat_and_cache_mla splits a row into kv_c and k_pe: D >= 2")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_moe_route_matches_the_reference_with_groups(gcu, with_bias, dtype):
    g = seeded(9)
    logits = randn(7, 32, g=g, dtype=dtype)
    bias = randn(32, g=g, scale=0.1) if with_bias else None
    args = (logits, bias, 6, 4, 2, 2.5, True, "sigmoid")
    assert chosen("moe_route", *args) == f"{EMU}.moe_route"
    weights, ids = hal.ops.moe_route(*args)
    ref_weights, ref_ids = hal.reference.moe_route(*args)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
    assert gcu.runtime.calls["fused_grouped_topk"] == 1


def test_moe_route_declines_groups_of_one_and_underflowing_sigmoid_scores(gcu):
    assert rejection("moe_route", torch.ones(2, 8), None, 3, 8, 3, 1.0, True, "sigmoid").startswith(
        "vLLM's grouped_topk scores a group by its best two experts (topk(2)): groups of 1 expert")
    assert "logits below -80" in rejection("moe_route", torch.full((2, 8), -100.0), None, 2, 1, 1, 1.0, True,
                                           "sigmoid")
    assert gcu.runtime.calls["fused_grouped_topk"] == 0


def fp8_operands(m: int, n: int, k: int, g: torch.Generator):
    a = randn(m, k, g=g).to(torch.float8_e4m3fn)
    w = randn(n, k, g=g).to(torch.float8_e4m3fn)
    return a, torch.rand(m, k // 128, generator=g), w, torch.rand(-(-n // 128), k // 128, generator=g)


@pytest.mark.parametrize("out_dtype", [F16, BF16])
def test_fp8_block_gemm_matches_the_reference_on_gcu400(gcu, out_dtype):
    a, a_scale, w, w_scale = fp8_operands(5, 130, 256, seeded(6))
    assert chosen("fp8_block_gemm", a, a_scale, w, w_scale, out_dtype) == f"{EMU}.fp8_block_gemm"
    torch.testing.assert_close(hal.ops.fp8_block_gemm(a, a_scale, w, w_scale, out_dtype),
                               hal.reference.fp8_block_gemm(a, a_scale, w, w_scale, out_dtype), rtol=1.6e-2, atol=1e-2)
    assert gcu.runtime.calls["linear_quant"] == 1


def test_fp8_block_gemm_with_no_columns_is_zero_though_the_op_writes_nothing(gcu):
    a, w = torch.empty(2, 0, dtype=torch.float8_e4m3fn), torch.empty(3, 0, dtype=torch.float8_e4m3fn)
    out = hal.ops.fp8_block_gemm(a, torch.empty(2, 0), w, torch.empty(1, 0), BF16)
    assert chosen("fp8_block_gemm", a, torch.empty(2, 0), w, torch.empty(1, 0), BF16) == f"{EMU}.fp8_block_gemm"
    assert torch.equal(out, torch.zeros(2, 3, dtype=BF16))


def test_fp8_block_gemm_declines_float32_out_and_a_gcu300(hal_state, monkeypatch):
    a, a_scale, w, w_scale = fp8_operands(2, 3, 128, seeded(7))
    register(hal_state, monkeypatch)
    assert rejection("fp8_block_gemm", a, a_scale, w, w_scale, F32) == (
        "linear_quant serves w8a8_block_fp8_matmul, whose outputs are fp16/bf16, not float32")
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch, "gcu300")
    assert rejection("fp8_block_gemm", a, a_scale, w, w_scale, BF16) == (
        "device Enflame S60 does not support float8_e4m3fn (capabilities: {bfloat16, float16, float32})")


def test_the_emulated_op_checks_its_schema():
    ops = GcuEmulator().ops._C
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.empty(2, 8), torch.ones(2, 8), torch.ones(8, dtype=BF16), 1e-6)
    with pytest.raises(RuntimeError, match="positions must be int64"):
        ops.rotary_embedding(torch.zeros(2, dtype=I32), torch.ones(2, 4), torch.ones(2, 4), 4, torch.ones(2, 4), True)


def enflame_torch() -> types.SimpleNamespace:
    """A torch with torch_gcu loaded and transfer_to_gcu applied: `torch.gcu` set, and torch.cuda
    answering (here: a CUDA version string and one device) as it would for GCUs."""
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                 get_device_name=lambda device=0: "Enflame S60")
    return types.SimpleNamespace(gcu=types.SimpleNamespace(), cuda=cuda, __version__="2.7.0",
                                 version=types.SimpleNamespace(cuda="12.8", hip=None))


def test_no_cuda_type_backend_takes_a_gcu_whose_torch_cuda_was_patched():
    from glm5_hal.backends.cuda import CudaBackend
    from glm5_hal.backends.dcu import DcuBackend
    from glm5_hal.backends.dcu.runtime import DcuRuntime
    from glm5_hal.backends.iluvatar import IluvatarBackend
    from glm5_hal.backends.iluvatar.runtime import IluvatarRuntime
    fake = enflame_torch()
    assert vendors.cuda_flavor(fake) == "enflame"
    cuda = CudaBackend(runtime=types.SimpleNamespace(EMULATOR=True, torch=fake, package_versions=lambda: {}),
                       name="cuda_probe", device_type="cpu")
    assert cuda.availability().reason.startswith("this torch is an Enflame GCU stack (torch.gcu is set")
    dcu = DcuBackend(runtime=DcuRuntime(fake), name="dcu_probe", device_type="cpu")
    assert dcu.availability().reason == "this is an Enflame GCU stack (torch.gcu is set), not a Hygon DCU"
    iluvatar = IluvatarBackend(runtime=IluvatarRuntime(fake), name="iluvatar_probe", device_type="cpu")
    assert iluvatar.availability().reason.startswith("this is an Enflame GCU stack (torch.gcu is set; torch_gcu's "
                                                     "transfer_to_gcu makes torch.cuda answer for GCUs)")


def test_process_groups_on_gcu_use_eccl():
    from glm5_hal.dist.group import backend_for_device
    assert backend_for_device("gcu") == "eccl"    # the vendor table: gcu is Enflame's alone


def test_a_torch_gcu_without_its_libraries_is_named_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "torch_gcu").mkdir()
    (tmp_path / "torch_gcu" / "__init__.py").write_text(
        "raise ImportError('libexample.so.2: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_gcu", raising=False)
    reason = EnflameBackend().availability().reason
    assert reason.startswith("runtime library missing: libexample.so.2 (torch_gcu is installed, but the vendor "
                             "runtime is not on the library path")
    sys.modules.pop("torch_gcu", None)


# -- what dispatch remembers with a call key ----------------------------------------------------------
def test_a_metadata_predicate_is_remembered_with_the_call_key_and_the_cache_layout_is_checked_per_call(gcu):
    """rms_norm's predicate reads dtypes and the probed vllm-gcu only (supports_metadata): the
    adapter is remembered with the call key. kv_cache_write's reads whether the cache is
    contiguous, which the key does not hold (only whether it is paged): a block-strided page
    view with the key of a contiguous cache is declined, per call."""
    g = seeded(41)
    x, w = randn(4, 72, g=g), randn(72, g=g)
    assert remembered(hal.ops.rms_norm, x, w, 1e-6) is gcu.impls["rms_norm"].fn
    hal.ops.rms_norm(x, w, 1e-6)
    assert gcu.runtime.calls["rms_norm"] == 2

    values, slots = randn(2, 4, g=g), torch.tensor([0, 5])
    assert_page_view_write_declined_per_call((3, 2, 4), values, slots,
                                             lambda: gcu.runtime.calls["concat_and_cache_mla"])
