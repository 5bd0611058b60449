"""The kunlun backend: it claims `cuda` devices only when the stack is Kunlun's (never an
NVIDIA GPU), probe reasons, capabilities, and every adapter run end to end against the
emulator of kunlun_ops / torch.ops._C / xspeedgate_ops (tests/emulators/kunlun.py) on CPU
tensors, compared with glm5_hal.reference; calls outside the vendor limits are declined with
a reason and never reach the vendor kernels."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import glm5_hal as hal
from glm5_hal import reference as ref
from glm5_hal import vendors
from glm5_hal.backends.kunlun import KunlunBackend, ops as xpu_ops
from emulators.sparse_decode import SparseDecodeKernelStandIn
from emulators.kunlun import VLLM_KUNLUN_VERSIONS, KvGatherKernelStandIn, NotEmulatedError, XpuEmulator

from conftest import seeded
from emulated_helpers import assert_page_view_write_declined_per_call, remembered

EMU = "kunlun_emu"
BF16, F16, F32, FP8, I32 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32


def as_plugin(backend) -> types.ModuleType:
    module = types.ModuleType("kunlun_emulated_plugin")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def emulated(chip: str = "P800", kernel_library=None, **runtime_kwargs) -> KunlunBackend:
    return KunlunBackend(runtime=XpuEmulator(chip, **runtime_kwargs), name=EMU, device_type="cpu",
                         priority=1000, kernel_library=kernel_library)


@pytest.fixture
def register(hal_state, monkeypatch):
    """Registers an emulated backend at run time with the cpu backend disabled, as on an
    XPU host: declined calls then reach the reference (a FallbackWarning), not cpu kernels."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")

    def load(backend):
        hal_state(as_plugin(backend), EMU)
        assert backend.availability().available, backend.availability().reason
        return backend
    return load


@pytest.fixture
def xpu(register):
    """An emulated P800 backend registered at run time; yields its runtime."""
    return register(emulated()).runtime


def chosen(op, *args):
    return hal.explain(op, *args).chosen


def rejection(op, *args) -> str:
    return dict(hal.explain(op, *args).rejected).get(f"{EMU}.{op}", "")


def close(out, expected, dtype):
    tol = {F32: (1.3e-6, 1e-5), F16: (1e-3, 1e-5), BF16: (1.6e-2, 1e-5)}[dtype]
    torch.testing.assert_close(out.double(), expected.double(), rtol=tol[0], atol=tol[1])


def up(t):
    return t.double() if t.is_floating_point() else t


# -- which cuda is Kunlun ------------------------------------------------------------------------
def test_without_torch_xmlir_the_registered_backend_says_the_bridge_is_missing():
    row = next(r for r in hal.backends() if r.name == "kunlun")
    assert (row.available, row.reason, row.device_type) == (False, "bridge torch_xmlir not installed", "cuda")
    assert {"rms_norm", "moe_permute", "grouped_gemm", "sparse_mla_decode_paged"} <= set(row.ops)
    assert not {"indexer_topk", "indexer_topk_paged"} & set(row.ops)   # not served: see the next section


def fake_module(tmp_path, monkeypatch, name: str, body: str = "__version__ = '2.5.1.7'\n") -> None:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Recorded as absent, so the fake module leaves sys.modules again after the test.
    monkeypatch.setitem(sys.modules, name, None)
    del sys.modules[name]


class FakeCuda:
    def __init__(self, name: str, count: int = 1) -> None:
        self.name, self.count = name, count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_device_name(self, device=None) -> str:
        return self.name


def fake_torch(device_name: str, **attrs):
    t = types.SimpleNamespace(__version__="2.5.1", version=types.SimpleNamespace(cuda="12.1", hip=None),
                              cuda=FakeCuda(device_name),
                              ops=types.SimpleNamespace(_C=types.SimpleNamespace(),
                                                        xspeedgate_ops=types.SimpleNamespace()))
    for key, value in attrs.items():
        setattr(t, key, value)
    return t


def test_an_nvidia_machine_is_never_claimed():
    nvidia = fake_torch("NVIDIA H100 80GB HBM3")
    assert vendors.cuda_flavor(nvidia) == "cuda"
    assert KunlunBackend(torch_module=nvidia).availability() == hal.Availability(
        False, "bridge torch_xmlir not installed")


def test_an_nvidia_gpu_is_refused_even_with_torch_xmlir_installed(tmp_path, monkeypatch):
    fake_module(tmp_path, monkeypatch, "torch_xmlir")
    fake_module(tmp_path, monkeypatch, "kunlun_ops")
    nvidia = fake_torch("NVIDIA H100 80GB HBM3")
    assert vendors.cuda_flavor(nvidia) == "kunlun"      # torch_xmlir is what identifies Kunlun ...
    availability = KunlunBackend(torch_module=nvidia).availability()
    assert availability == hal.Availability(False, "cuda device 0 is 'NVIDIA H100 80GB HBM3', an NVIDIA GPU: "
                                                   "the kunlun backend only claims Kunlun XPUs")   # ... but not alone


def test_a_dcu_torch_with_a_stray_torch_xmlir_is_not_kunlun(tmp_path, monkeypatch):
    fake_module(tmp_path, monkeypatch, "torch_xmlir", "raise SystemExit('imported torch_xmlir')\n")
    dcu = fake_torch("K100_AI", __hcu_version__="2.9.0+das.dtk2604")
    assert KunlunBackend(torch_module=dcu).availability() == hal.Availability(
        False, "torch_xmlir is installed but this torch build is the 'dcu' stack (glm5_hal.vendors.cuda_flavor), "
               "not Kunlun's CUDA-compatible mode")
    assert "torch_xmlir" not in sys.modules


def test_a_kunlun_stack_with_a_p800_is_claimed(tmp_path, monkeypatch):
    fake_module(tmp_path, monkeypatch, "torch_xmlir")
    fake_module(tmp_path, monkeypatch, "kunlun_ops")
    backend = KunlunBackend(torch_module=fake_torch("P800", __version__="2.5.1+xpytorch"))
    # vLLM-Kunlun (whose _C ops the MoE adapters call) is not installed: those are narrowed away
    assert backend.availability() == hal.Availability(True, (
        "1 x P800 (Kunlun3, CUDA-compatible mode), torch 2.5.1+xpytorch; narrowed to what is verified (moe_kernels: "
        "vllm-kunlun is not installed; w8a8_max_scales: vllm-kunlun is not installed)"))
    assert backend.runtime.xspeedgate is None
    assert backend.runtime.xspeedgate_missing.startswith("xspeedgate_ops not installed")
    assert backend.versions() == {"torch_xmlir": "2.5.1.7", "torch": "2.5.1+xpytorch", "chip": "P800"}


def test_missing_xre_library_is_named(tmp_path, monkeypatch):
    fake_module(tmp_path, monkeypatch, "torch_xmlir", "raise ImportError('libxpurt.so: cannot open shared object "
                                                      "file: No such file or directory')\n")
    reason = KunlunBackend().availability().reason
    assert reason.startswith("runtime library missing: libxpurt.so (torch_xmlir is installed")
    assert "XTDK_PATH/XRE_PATH" in reason


@pytest.mark.parametrize("fused,expected", [
    (None, "kunlun_ops / xtorch_ops not installed (Kunlun's fused-op library, which the kunlun adapters call)"),
    ("xtorch_ops", "no Kunlun XPU visible (torch.cuda.device_count() == 0; check `xpu-smi -L` and "
                   "XPU_VISIBLE_DEVICES)"),
])
def test_the_fused_op_library_is_required_under_either_name(tmp_path, monkeypatch, fused, expected):
    fake_module(tmp_path, monkeypatch, "torch_xmlir")
    if fused:
        fake_module(tmp_path, monkeypatch, fused)
    assert KunlunBackend().availability() == hal.Availability(False, expected)   # this CPU torch sees no XPU


@pytest.mark.parametrize("chip,kwargs,expected", [
    ("P800", {"devices": 0}, "no Kunlun XPU visible (torch.cuda.device_count() == 0"),
    ("P800", {"torch_version": "2.1.0+xmlir"},
     "torch 2.1.0+xmlir is too old: Kunlun's CUDA-compatible mode (xpytorch) is torch >= 2.5"),
    ("R200", {}, "unsupported XPU R200 (Kunlun2): the kunlun backend targets Kunlun3 (P800) under xpytorch"),
    ("A100", {}, "cuda device 0 is 'NVIDIA A100-SXM4-80GB', an NVIDIA GPU"),
])
def test_probe_gives_a_specific_reason(chip, kwargs, expected):
    availability = emulated(chip, **kwargs).availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


def test_capabilities():
    backend = emulated()
    assert backend.availability().reason == ("EMULATED (XpuEmulator): 8 x P800 (Kunlun3, CUDA-compatible mode), "
                                             "torch 2.5.1+xpytorch, vllm-kunlun 0.15.1.dev0")
    assert backend.versions()["vllm-kunlun"] == "0.15.1.dev0"
    caps = backend.cached_capabilities()
    assert caps.dtypes == {F32, F16, BF16, torch.int8} and caps.dist_backend == "nccl" and caps.device_name == "P800"
    assert caps.limits["fp8"] is False and caps.limits["indexer_key_quantisation"] == "int8 (no FP8 on P800)"
    assert caps.limits["xpu_kernels"].startswith("kunlun kernel not built")
    assert caps.limits["xspeedgate_ops"] == "installed"
    assert set(xpu_ops.OP_LIMITS) <= set(caps.limits)


# -- common ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (F16, F32), (BF16, BF16), (BF16, F16)])
def test_rms_norm_hands_the_weight_over_in_float32(xpu, dtype, wdtype):
    g = seeded(1)
    x = torch.randn(3, 4, 72, generator=g).to(dtype)[..., :65]
    w = (torch.rand(65, generator=g) + 0.5).to(wdtype)
    assert chosen("rms_norm", x, w, 1e-5) == f"{EMU}.rms_norm"
    close(hal.ops.rms_norm(x, w, 1e-5), ref.rms_norm(up(x), up(w), 1e-5), dtype)
    assert xpu.calls["kunlun_ops.rmsnorm"] == 1


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_silu_and_mul(xpu, dtype):
    x = torch.randn(5, 2, 2 * 20, generator=seeded(2)).to(dtype)
    close(hal.ops.silu_and_mul(x), ref.silu_and_mul(up(x)), dtype)
    assert xpu.calls["kunlun_ops.silu_and_mul"] == 1


def test_the_emulator_does_not_guess_the_other_half_order():
    with pytest.raises(NotEmulatedError, match="turn=False"):
        XpuEmulator().kunlun_ops.silu_and_mul(torch.ones(2, 4), turn=False)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_hadamard_transform(xpu, dtype):
    x = torch.randn(2, 3, 128, generator=seeded(3)).to(dtype)
    close(hal.ops.hadamard_transform(x, 128 ** -0.5), ref.hadamard_transform(up(x), 128 ** -0.5), dtype)
    assert xpu.calls["xspeedgate_ops.hadamard_transform"] == 1


def test_hadamard_transform_needs_xspeedgate_ops(register):
    register(emulated(speedgate=False))
    assert rejection("hadamard_transform", torch.randn(2, 16), 1.0) == "xspeedgate_ops not installed (emulated)"


# -- MoE -----------------------------------------------------------------------------------------
def route_matches(logits, args):
    weights, ids = hal.ops.moe_route(logits, *args)
    ref_weights, ref_ids = ref.moe_route(up(logits), *args)
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    torch.testing.assert_close(weights.gather(1, ids.argsort(dim=1)).double(),
                               ref_weights.gather(1, ref_ids.argsort(dim=1)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("vllm_kunlun", VLLM_KUNLUN_VERSIONS)
@pytest.mark.parametrize("args", [
    ("bias", 8, 4, 2, 2.5, True, "sigmoid"),
    ("bias", 8, 1, 1, 2.5, True, "sigmoid"),
    (None, 6, 4, 2, 1.0, True, "sigmoid"),     # no bias: a zero bias tensor (the schema's bias is a Tensor)
    (None, 3, 1, 1, 1.5, True, "softmax"),     # moe_softmax_topk_norm
    (None, 3, 1, 1, 2.0, False, "softmax"),    # moe_softmax_topk with an empty block_statistic
])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_moe_route(register, vllm_kunlun, args, dtype):
    """bf16 router logits reach the kernels as float32, as vLLM-Kunlun casts them; each emulated
    vLLM-Kunlun version."""
    register(emulated(vllm_kunlun=vllm_kunlun))
    g = seeded(4)
    logits = torch.randn(21, 32, generator=g).to(dtype)
    bias = torch.randn(32, generator=g) * 0.3
    route_matches(logits, (bias if args[0] == "bias" else None, *args[1:]))


def test_the_routing_kernels_are_called_as_vllm_kunlun_calls_them():
    """What the adapter used to get wrong, each refused by the emulator: an undefined
    block_statistic for moe_softmax_topk, scores of another dtype than the logits, no bias."""
    C = XpuEmulator().C
    logits, weights, ids = torch.randn(3, 8).to(BF16), torch.empty(3, 2), torch.empty(3, 2, dtype=I32)
    with pytest.raises(NotEmulatedError, match="undefined block_statistic"):
        C.moe_softmax_topk(logits.float(), weights, ids, None)
    with pytest.raises(NotEmulatedError, match="scores in the logits' dtype"):
        C.moe_softmax_topk(logits, weights, ids, torch.empty(0, dtype=I32))
    with pytest.raises(NotEmulatedError, match="casts the router logits to float32"):
        C.moe_softmax_topk_norm(x=logits, normed_score=weights, topk_index=ids, block_statistic=None)
    with pytest.raises(NotEmulatedError, match="undefined bias"):
        C.moe_sigmoid_group_topk_norm(x=logits.float(), topk_index=ids, norm_score=weights,
                                      block_static=torch.zeros(12, 8, dtype=I32), bias=None, scale=1.0, n_group=1,
                                      topk_group=1)
    with pytest.raises(TypeError, match="stable"):
        C.moe_softmax_topk(logits.float(), weights, ids, torch.empty(0, dtype=I32), stable=True)


def test_moe_route_declines_what_the_kernels_cannot_do(xpu):
    logits, bias = torch.randn(3, 16), torch.zeros(16)
    assert rejection("moe_route", logits, bias, 2, 1, 1, 1.0, False, "sigmoid") == (
        "moe_sigmoid_group_topk_norm always renormalises the selected weights (norm_topk_prob=False)")
    assert rejection("moe_route", logits, bias, 2, 1, 1, 1.0, True, "softmax") == (
        "moe_softmax_topk_norm has no selection bias (no Kunlun softmax kernel takes one)")
    assert rejection("moe_route", logits, None, 2, 4, 2, 1.0, True, "softmax") == (
        "moe_softmax_topk_norm does not limit experts to groups (n_group=4)")
    assert rejection("moe_route", torch.full((3, 16), -200.0), None, 2, 1, 1, 1.0, True, "sigmoid") == (
        "logits below -80: their float32 sigmoid scores underflow, and moe_sigmoid_group_topk_norm renormalises "
        "by a plain sum (0/0 is NaN; the contract adds 1e-20)")


def test_expert_counts_no_public_source_covers_are_declined(xpu):
    """No public source states the MoE kernels' expert ceiling (the 512 / 480 once cited came
    from a file vLLM-Kunlun never had): beyond the 256 experts its tutorials serve, the adapters
    decline and the emulator refuses to guess."""
    wide = torch.randn(3, 257)
    reason = ("moe_sigmoid_group_topk_norm is verified only up to 256 experts (no public source states its ceiling; "
              "vLLM-Kunlun's tutorials serve 256), got 257")
    assert rejection("moe_route", wide, None, 2, 1, 1, 1.0, True, "sigmoid") == reason
    assert chosen("moe_route", wide[:, :256], None, 2, 1, 1, 1.0, True, "sigmoid") == f"{EMU}.moe_route"
    with pytest.raises(NotEmulatedError, match="no public source documents the kernels above 256"):
        XpuEmulator().C.moe_softmax_topk_norm(x=wide, normed_score=torch.empty(3, 2), topk_index=torch.empty(
            3, 2, dtype=I32), block_statistic=None)


@pytest.mark.parametrize("version,reason", [
    ("0.10.0", "moe_kernels unverified here: vllm-kunlun 0.10.0 is older than 0.10.1, the oldest version moe_kernels "
               "was read from"),
    ("0.16.0", "moe_kernels unverified here: vllm-kunlun 0.16.0 is newer than 0.15.1, the newest version moe_kernels "
               "was verified against"),
    (None, "moe_kernels unverified here: vllm-kunlun is not installed"),
])
def test_the_moe_kernels_of_an_unverified_vllm_kunlun_are_declined(register, version, reason):
    backend = register(emulated(vllm_kunlun=version))
    assert "narrowed to what is verified (moe_kernels: " in backend.availability().reason
    logits = torch.randn(3, 16)
    assert rejection("moe_route", logits, None, 2, 1, 1, 1.0, True, "sigmoid") == reason
    assert rejection("grouped_gemm", torch.randn(2, 8), torch.randn(1, 4, 8), torch.tensor([2], dtype=I32)) == reason
    assert chosen("rms_norm", logits, torch.ones(16), 1e-5) == f"{EMU}.rms_norm"   # kunlun_ops: not versioned


def test_moe_permute(xpu):
    g = seeded(5)
    x = torch.randn(19, 16, generator=g).to(BF16)
    ids = torch.randint(0, 7, (19, 2), generator=g, dtype=I32)
    ids[0, 0], ids[4, 1], ids[18, 0] = -1, 7, 30
    for got, want in zip(hal.ops.moe_permute(x, ids, 7), ref.moe_permute(x, ids, 7)):
        assert torch.equal(got, want)
    assert xpu.calls["_C.gen_block_statistic"] == xpu.calls["_C.moe_pre_sorted"] == 1
    empty = torch.zeros((0, 2), dtype=I32)
    for got, want in zip(hal.ops.moe_permute(x[:0], empty, 7), ref.moe_permute(x[:0], empty, 7)):
        assert torch.equal(got, want)


@pytest.fixture
def poisoned_empty():
    """Uninitialised memory filled with a known value (int32 max, float NaN) by torch itself
    (use_deterministic_algorithms + fill_uninitialized_memory), as a reused XPU buffer holds
    whatever was there: a buffer the adapter leaves uninitialised cannot read as zero by luck."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("tokens, top_k, experts", [(5, 2, 8), (3, 1, 6), (19, 2, 7)])
def test_moe_permute_zero_fills_the_buffers_the_kernels_do_not_write_whole(xpu, poisoned_empty, tokens, top_k,
                                                                          experts):
    """block_statistic, expert_m, sorted_tokens_num_lod and moe_index start at zero as every
    vLLM-Kunlun call site allocates them: the emulated kernels write only what they have (fewer ids
    than 12 chunks leave histogram rows alone, an expert without rows keeps its expert_m, lod[0]
    is not written), so an uninitialised buffer would reach the result."""
    g = seeded(6)
    x = torch.randn(tokens, 16, generator=g).to(BF16)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=I32)
    for got, want in zip(hal.ops.moe_permute(x, ids, experts), ref.moe_permute(x, ids, experts)):
        assert torch.equal(got, want)
    assert xpu.calls["_C.moe_pre_sorted"] == 1
    assert xpu.C.unzeroed_buffers == []     # moe_index included, which the emulated kernel writes whole


def test_moe_route_zero_fills_the_sigmoid_kernels_block_static(xpu, poisoned_empty):
    """fused_moe allocates the [12, E] block_static with torch.zeros (ops/_kunlun_ops.py:406
    @09869ee); the routing outputs do not show it, the emulator's record of buffers that arrive
    non-zero does."""
    g = seeded(7)
    logits, bias = torch.randn(5, 16, generator=g), torch.randn(16, generator=g)
    args = (logits, bias, 2, 4, 2, 2.5, True, "sigmoid")
    assert chosen("moe_route", *args) == f"{EMU}.moe_route"
    for got, want in zip(hal.ops.moe_route(*args), ref.moe_route(*args)):
        torch.testing.assert_close(got, want)
    assert xpu.calls["_C.moe_sigmoid_group_topk_norm"] == 1 and xpu.C.unzeroed_buffers == []


def test_the_emulated_moe_kernels_leave_what_they_do_not_write():
    """The emulator's side of the test above: with buffers that do not start at zero, the
    histogram check of moe_pre_sorted trips and expert_m keeps what an empty expert had."""
    from emulators.kunlun import XpuOpError
    C = XpuEmulator("P800").C
    ids = torch.tensor([[0, 2], [2, 3]], dtype=I32)
    histogram = torch.full((12, 5), 7, dtype=I32)
    C.gen_block_statistic(ids, histogram)
    assert torch.equal(histogram[4:], torch.full((8, 5), 7, dtype=I32))      # 4 ids: rows 4-11 untouched
    expert_m, lod = torch.full((5,), 9, dtype=I32), torch.full((6,), 9, dtype=I32)
    args = dict(x=torch.randn(2, 4), topk_index=ids, moe_expand=torch.empty(4, 4),
                moe_index=torch.zeros(4, dtype=I32), expert_m=expert_m, sorted_tokens_num_lod=lod)
    with pytest.raises(XpuOpError, match="block_statistic is not the histogram"):
        C.moe_pre_sorted(block_statistic=histogram, **args)
    fresh = torch.zeros(12, 5, dtype=I32)
    C.gen_block_statistic(ids, fresh)
    C.moe_pre_sorted(block_statistic=fresh, **args)
    assert expert_m.tolist() == [1, 9, 2, 1, 9] and lod.tolist() == [9, 1, 1, 3, 4, 4]
    assert C.unzeroed_buffers == ["gen_block_statistic.block_statistic", "moe_pre_sorted.expert_m",
                                  "moe_pre_sorted.sorted_tokens_num_lod"]


def test_moe_permute_counts_the_dropped_id_expert_against_the_limit(xpu):
    x, ids = torch.randn(2, 4), torch.zeros(2, 1, dtype=I32)
    assert rejection("moe_permute", x, ids, 256) == (
        "moe_pre_sorted (with the dropped-id expert) is verified only up to 256 experts (no public source states its "
        "ceiling; vLLM-Kunlun's tutorials serve 256), got 257")
    assert chosen("moe_permute", x, ids, 255) == f"{EMU}.moe_permute"


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_moe_unpermute(xpu, dtype):
    g = seeded(6)
    ids = torch.randint(-1, 6, (13, 3), generator=g, dtype=I32)
    _, _, src = ref.moe_permute(torch.zeros(13, 1), ids, 6)
    y = torch.randn(src.shape[0], 24, generator=g).to(dtype)
    weights = torch.rand(13, 3, generator=g)
    close(hal.ops.moe_unpermute(y, src, weights), ref.moe_unpermute(up(y), src, weights.double()), dtype)
    assert xpu.calls["_C.moe_post"] == 1
    assert rejection("moe_unpermute", y[:2], torch.tensor([1, 1], dtype=I32), weights) == (
        "src repeats a (token, slot) index; moe_post combines one row per pair")


@pytest.mark.parametrize("vllm_kunlun", VLLM_KUNLUN_VERSIONS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_grouped_gemm_calls_moe_fc_as_vllm_kunlun_does(register, vllm_kunlun, dtype):
    """No fused activation and no topk_ids (optional in the real op; vLLM-Kunlun's unquantised
    path never passes them), y as [tokens, topk, N]."""
    xpu = register(emulated(vllm_kunlun=vllm_kunlun)).runtime
    g = seeded(7)
    counts = torch.tensor([700, 0, 390, 10], dtype=I32)
    x = torch.randn(1100, 32, generator=g).to(dtype)
    w = torch.randn(4, 24, 32, generator=g).to(dtype)
    close(hal.ops.grouped_gemm(x, w, counts), ref.grouped_gemm(up(x), up(w), counts), dtype)
    assert xpu.C.fc_acts == [None]
    assert rejection("grouped_gemm", x[:2], torch.randn(257, 24, 32).to(dtype),
                     torch.tensor([2] + [0] * 256, dtype=I32)).startswith(
        "moe_fc is verified only up to 256 experts")


def test_the_emulated_swish_glu_is_vllm_kunluns():
    """act="SWISH_GLU" (what vLLM-Kunlun uses from 1024 rows on) writes silu(gate) * up into
    the first half of a full-width y [M, topk, N]; the adapters never use it (grouped_gemm has
    no activation), but the emulator no longer models a defect nobody published."""
    C = XpuEmulator().C
    for rows in (1023, 1024):
        x, w = torch.randn(rows, 8, generator=seeded(8)), torch.randn(1, 6, 8, generator=seeded(9))
        y = torch.empty(rows, 1, 6)
        C.moe_fc(x=x, weight=w, sorted_tokens_num_lod=torch.tensor([0, rows], dtype=I32),
                 sorted_tokens_idx=torch.arange(rows, dtype=I32), moe_topk=1, y=y, act="SWISH_GLU")
        gate_up = x @ w[0].T
        want = torch.nn.functional.silu(gate_up[:, :3]) * gate_up[:, 3:]
        torch.testing.assert_close(y[:, 0, :3], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotEmulatedError, match="topk_ids with unquantised weights"):
        C.moe_fc(x=x, weight=w, sorted_tokens_num_lod=torch.tensor([0, rows], dtype=I32),
                 sorted_tokens_idx=torch.arange(rows, dtype=I32), moe_topk=1, y=y,
                 topk_ids=torch.zeros(rows, 1, dtype=I32))


# -- KV cache and DSA ------------------------------------------------------------------------------
def test_kv_cache_write_compares_the_whole_cache(xpu):
    g = seeded(10)
    cache = torch.randn(4, 5, 24, generator=g).to(BF16)
    values = torch.randn(6, 24, generator=g).to(BF16)
    for slots in (torch.tensor([19, -1, 0, 7, -1, 3], dtype=I32), torch.tensor([1, 2, 3, -1, 5, 6])):
        got, want = cache.clone(), cache.clone()
        hal.ops.kv_cache_write(got, values, slots)
        ref.kv_cache_write(want, values, slots)
        assert torch.equal(got, want)
    assert xpu.calls["kunlun_ops.reshape_and_cache"] == 2


def test_the_indexer_is_not_implemented_rather_than_quantised(xpu):
    """Kunlun's indexer kernels score int8-quantised queries and keys, which the contract's
    numerics rule out: the backend declares no indexer op, so dispatch never considers it."""
    q, k = torch.randn(3, 2, 128).to(BF16), torch.randn(9, 128).to(BF16)
    weights, starts, ends = torch.rand(3, 2), torch.zeros(3, dtype=I32), torch.tensor([1, 2, 3], dtype=I32)
    assert rejection("indexer_topk", q, k, weights, starts, ends, 2) == "does not implement indexer_topk"
    cache, table = torch.randn(2, 16, 128).to(BF16), torch.tensor([[0, 1]], dtype=I32)
    assert rejection("indexer_topk_paged", q[None, :1], cache, weights[None, :1], table,
                     torch.tensor([20], dtype=I32), 4) == "does not implement indexer_topk_paged"
    assert not {"indexer_topk", "indexer_topk_paged"} & set(hal.get_backend(EMU).impls)
    assert xpu_ops.INDEXER_NOT_SERVED.startswith("the Kunlun indexer kernels (I8_paged_mqa_logits / I8_mqa_logits) "
                                                 "score int8-quantised queries and keys")


def paged(g, lens, block_size, dim, dtype):
    blocks_per_seq = [-(-n // block_size) for n in lens]
    total = sum(blocks_per_seq) + 1
    perm = torch.randperm(total, generator=g)
    table = torch.full((len(lens), max(blocks_per_seq)), -1, dtype=I32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        table[b, :nb] = perm[used:used + nb].to(I32)
        used += nb
    return torch.randn(total, block_size, dim, generator=g).to(dtype), table, torch.tensor(lens, dtype=I32)


def test_the_xpu_kernels_decline_until_built(xpu):
    cache, table, lens = paged(seeded(11), [5, 12], 4, 32, BF16)
    assert rejection("kv_cache_gather", cache, table, lens).startswith(
        "kunlun kernel not built (libglm5_hal_kunlun_kernels.so not found")
    q, indices = torch.randn(2, 1, 3, 32).to(BF16), torch.zeros(2, 1, 4, dtype=I32)
    assert rejection("sparse_mla_decode_paged", q, cache, table, lens, indices, 0.1, 16).startswith(
        "kunlun kernel not built")


def test_kv_cache_gather_through_the_kernel_interface(register):
    stand_in = KvGatherKernelStandIn()
    register(emulated(kernel_library=stand_in))
    cache, table, lens = paged(seeded(12), [5, 0, 12], 4, 20, F16)
    assert torch.equal(hal.ops.kv_cache_gather(cache, table, lens), ref.kv_cache_gather(cache, table, lens))
    assert stand_in.launches == 1


def test_sparse_mla_decode_paged_through_the_kernel_interface(register):
    stand_in = SparseDecodeKernelStandIn()
    register(emulated(kernel_library=stand_in))
    g = seeded(13)
    cache, table, lens = paged(g, [7, 30], 8, 80, BF16)
    q = torch.randn(2, 2, 4, 80, generator=g).to(BF16)
    indices = torch.randint(-2, 33, (2, 2, 9), generator=g, dtype=I32)
    out, lse = hal.ops.sparse_mla_decode_paged(q, cache, table, lens, indices, 80 ** -0.5, 64)
    want_out, want_lse = ref.sparse_mla_decode_paged(up(q), up(cache), table, lens, indices, 80 ** -0.5, 64)
    close(out, want_out, BF16)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert stand_in.launches == 1


# -- the conformance suite over the emulated backend -----------------------------------------------
def test_conformance_tiny_preset_on_the_emulated_backend(register):
    """Every case of every op the adapters implement passes or is declined with a reason, every
    op passes at least one case unless the backend declines it everywhere; nothing fails."""
    from glm5_hal.conformance import cases, plan, run_all
    backend = register(emulated())
    ops = [op for op in sorted(backend.impls) if op in cases.ops_with_cases()]
    assert "rms_norm" in ops
    records = run_all(plan([EMU], ops, ["tiny"]))
    broken = [(r.case, r.status, r.reason) for r in records if r.status not in ("pass", "fallback", "skip")]
    assert not broken
    assert not [r for r in records if "supports() raised" in r.reason]
    declined = {"sparse_mla_decode_paged", "kv_cache_gather"}   # the XPU kernels are not built here
    # expected-error cases pass before any implementation runs (impl ""): not the adapter's pass
    passed = {r.op for r in records if r.status == "pass" and r.impl}
    assert passed == {r.op for r in records} - declined, passed
    assert all(r.impl == f"{EMU}.{r.op}" for r in records if r.status == "pass" and r.impl)


# -- the tiny GLM-5 model on the emulated backend --------------------------------------------------
@pytest.mark.slow
def test_the_tiny_glm5_model_runs_on_the_emulated_backend(xpu):
    import warnings
    from glm5_hal.models import GLM5Config, GLM5ForCausalLM

    def run(backend_name):
        model = GLM5ForCausalLM(GLM5Config.tiny(), seed=3)
        prompts = [torch.randint(0, 512, (n,), generator=seeded(n)).tolist() for n in (9, 4)]
        with hal.use(backend_name), warnings.catch_warnings():
            warnings.simplefilter("ignore", hal.FallbackWarning)
            cache = model.new_cache(12, 4)
            out = [model.prefill(cache, ["a", "b"], prompts)]
            out += [model.decode(cache, ["a", "b"], [t, t]) for t in (5, 77, 301)]
        return torch.cat(out)

    logits = run(EMU)
    for op in ("kunlun_ops.rmsnorm", "kunlun_ops.silu_and_mul", "kunlun_ops.reshape_and_cache",
               "xspeedgate_ops.hadamard_transform", "_C.moe_sigmoid_group_topk_norm", "_C.moe_pre_sorted",
               "_C.moe_fc", "_C.moe_post"):
        assert xpu.calls[op] > 0, op
    assert set(xpu.C.fc_acts) == {None}
    torch.testing.assert_close(logits, run("reference"), atol=1e-3, rtol=1e-3)


# -- the ctypes side of kernels.py, against a compiled stand-in library ------------------------------
STUB_SOURCE = r"""
#include <stdint.h>
#include <string.h>
int glm5_hal_sparse_mla_decode_paged(void) { return 0; }
int glm5_hal_xpu_kv_cache_gather(const void* cache, const int32_t* table, const int32_t* lens,
    const int64_t* offsets, void* out, int64_t batch, int64_t num_blocks, int64_t block_size,
    int64_t max_blocks, int64_t row_bytes, void* stream) {
  /* A host-memory version of the kernel's contract: enough to check the marshalling. */
  for (int64_t b = 0; b < batch; ++b)
    for (int32_t p = 0; p < lens[b]; ++p) {
      int32_t block = table[b * max_blocks + p / block_size];
      memcpy((char*)out + (offsets[b] + p) * row_bytes,
             (const char*)cache + ((int64_t)block * block_size + p % block_size) * row_bytes, row_bytes);
    }
  return stream == (void*)0 ? 0 : 3;
}
"""


def test_kernels_py_gathers_through_a_compiled_library(tmp_path, register):
    import shutil
    import subprocess
    from glm5_hal.backends.kunlun.kernels import KernelLibrary
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in kernel library")
    source, library_path = tmp_path / "stub.c", tmp_path / "libstub.so"
    source.write_text(STUB_SOURCE)
    subprocess.run([compiler, "-shared", "-fPIC", "-O0", str(source), "-o", str(library_path)], check=True)
    library = KernelLibrary(library_path)
    register(emulated(kernel_library=library))
    cache, table, lens = paged(seeded(14), [6, 0, 3], 4, 10, BF16)
    assert chosen("kv_cache_gather", cache, table, lens) == f"{EMU}.kv_cache_gather"
    assert torch.equal(hal.ops.kv_cache_gather(cache, table, lens), ref.kv_cache_gather(cache, table, lens))
    offsets = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="failed with status 3"):
        library.kv_cache_gather(cache, table, lens, offsets, torch.empty(9, 10, dtype=BF16), 1)


# -- the checkpoints' INT8 GEMMs: vLLM-Kunlun's W8A8 kernels ----------------------------------------
def int8_inputs(g, m=9, n=24, k=40, experts=None):
    x, x_scale = ref.int8_quant(torch.randn(m, k, generator=g))
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    w_scale = torch.rand(*shape[:-1], generator=g) * 0.01 + 0.001
    return x, x_scale, w, w_scale


@pytest.mark.parametrize("vllm_kunlun", VLLM_KUNLUN_VERSIONS[1:])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_gemm_through_c_matmul(register, vllm_kunlun, bias):
    """_C.matmul with per-token and per-channel maxima (scale * 127: "kunlun_ops use max as
    scale"), as vLLM-Kunlun's W8A8 linear calls it."""
    xpu = register(emulated(vllm_kunlun=vllm_kunlun)).runtime
    g = seeded(30)
    x, x_scale, w, w_scale = int8_inputs(g)
    args = (x, x_scale, w, w_scale, BF16, torch.randn(24, generator=g) if bias else None)
    assert chosen("int8_gemm", *args) == f"{EMU}.int8_gemm"
    close(hal.ops.int8_gemm(*args), ref.int8_gemm(*args), BF16)
    assert xpu.calls["_C.matmul"] == 1


@pytest.mark.parametrize("vllm_kunlun", VLLM_KUNLUN_VERSIONS[1:])
def test_int8_grouped_gemm_through_moe_fc(register, vllm_kunlun):
    xpu = register(emulated(vllm_kunlun=vllm_kunlun)).runtime
    g = seeded(31)
    counts = torch.tensor([4, 0, 3, 2], dtype=I32)
    x, x_scale, w, w_scale = int8_inputs(g, experts=4)
    args = (x, x_scale, w, w_scale, counts, F16)
    assert chosen("int8_grouped_gemm", *args) == f"{EMU}.int8_grouped_gemm"
    close(hal.ops.int8_grouped_gemm(*args), ref.int8_grouped_gemm(*args), F16)
    assert xpu.calls["_C.moe_fc"] == 1 and xpu.C.fc_acts == [None]


def test_int8_gemms_decline_what_vllm_kunlun_does_not_show(register):
    x, x_scale, w, w_scale = int8_inputs(seeded(32))
    register(emulated())
    assert rejection("int8_gemm", x, x_scale, w, w_scale, F32, None) == (
        "matmul is called with the activations' bf16/fp16 as out_dtype by vLLM-Kunlun; torch.float32 is UNVERIFIED")
    hal.unload_plugin(EMU)
    register(emulated(vllm_kunlun="0.10.1.1"))      # no W8A8 path (nor _C.matmul) before 0.11.0
    assert rejection("int8_gemm", x, x_scale, w, w_scale, BF16, None) == (
        "torch.ops._C lacks matmul (vLLM-Kunlun's kernel library is not loaded in this process)")
    counts = torch.tensor([9], dtype=I32)
    assert rejection("int8_grouped_gemm", x, x_scale, w[None], w_scale[None], counts, BF16) == (
        "w8a8_max_scales unverified here: vllm-kunlun 0.10.1.1 is older than 0.11.0, the oldest version "
        "w8a8_max_scales was read from")


# -- what dispatch remembers with a call key ----------------------------------------------------------
def test_a_metadata_predicate_is_remembered_with_the_call_key_and_the_cache_layout_is_checked_per_call(xpu):
    """hadamard_transform's predicate reads the registered ops and a size only
    (supports_metadata): the adapter is remembered with the call key. kv_cache_write's reads
    whether the cache is contiguous, which the key does not hold (only whether it is paged): a
    block-strided page view with the key of a contiguous cache is declined, per call."""
    backend = hal.get_backend(EMU)
    x = torch.randn(2, 3, 128, generator=seeded(41))
    assert remembered(hal.ops.hadamard_transform, x, 128 ** -0.5) is backend.impls["hadamard_transform"].fn
    hal.ops.hadamard_transform(x, 128 ** -0.5)
    assert xpu.calls["xspeedgate_ops.hadamard_transform"] == 2

    values, slots = torch.randn(3, 24, generator=seeded(42)), torch.tensor([19, -1, 3], dtype=I32)
    assert_page_view_write_declined_per_call((4, 5, 24), values, slots,
                                             lambda: xpu.calls["kunlun_ops.reshape_and_cache"])
