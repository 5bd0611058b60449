"""The Iluvatar CoreX backend: which torch stacks it claims (CoreX only, identified as FlagGems
does: torch.corex, else ixsmi on a non-NVIDIA CUDA torch; never NVIDIA, DCU, Kunlun or an
Enflame torch whose torch.cuda answers for GCUs), probe reasons, capabilities per product, the
versioned behaviours, and every vendor adapter run end to end against the CoreX emulator
(tests/emulators/iluvatar.py) on CPU tensors, compared with glm5_hal.reference; declined calls
name the reason and never reach the vendor function."""
from __future__ import annotations

import functools
import sys
import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal import vendors
from glm5_hal.backends.iluvatar import IluvatarBackend
from glm5_hal.backends.iluvatar import chips
from glm5_hal.backends.iluvatar.runtime import IluvatarRuntime, run_query_tool
from emulators.iluvatar import IluvatarEmulator

from conftest import seeded
from emulated_helpers import chosen, declined_reason, randn, register_emulated, remembered, same_call_key

EMU = "iluvatar_emu"
F32, F16, BF16, I32, I8 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8
rejection = functools.partial(declined_reason, EMU)


def emulated(card: str = "BI-V150", **runtime_kwargs) -> IluvatarBackend:
    return IluvatarBackend(runtime=IluvatarEmulator(card, **runtime_kwargs), name=EMU, device_type="cpu",
                           priority=1000)


def register(hal_state, monkeypatch, card: str = "BI-V150", **runtime_kwargs) -> IluvatarBackend:
    return register_emulated(hal_state, monkeypatch, emulated(card, **runtime_kwargs))


@pytest.fixture
def corex(hal_state, monkeypatch) -> IluvatarBackend:
    return register(hal_state, monkeypatch)


# -- which stack is CoreX --------------------------------------------------------------------------
def test_on_a_cpu_torch_the_registered_backend_says_there_is_no_cuda():
    row = next(r for r in hal.backends() if r.name == "iluvatar")
    assert (row.available, row.device_type) == (False, "cuda")
    assert row.reason == ("torch build has no CUDA-compatible device support (torch.version.cuda is None), "
                          "so no CoreX")
    assert {"rms_norm", "int8_quant", "int8_gemm", "indexer_topk", "sparse_mla_decode_paged"} <= set(row.ops)


@pytest.mark.parametrize("card,flavor,ixsmi,expected", [
    ("H100", "cuda", True, "this is a real NVIDIA GPU stack (device 0 is 'NVIDIA H100 80GB HBM3', torch has no "
                           "torch.corex), not Iluvatar CoreX"),
    # an ixsmi on PATH does not make an NVIDIA GPU CoreX: FlagGems asks the device name first
    ("H100", "corex-plain", True, "this is a real NVIDIA GPU stack"),
    ("BI-V150", "corex-plain", False, "torch has no CoreX marker (torch.corex, '+corex'; torch.version.cuda = 10.2) "
                                      "and ixsmi not found on PATH: not Iluvatar CoreX"),
    ("BI-V150", "dcu", True, "this is a Hygon DCU stack (torch.__hcu_version__), not Iluvatar CoreX"),
    ("BI-V150", "enflame", True, "this is an Enflame GCU stack (torch.gcu is set; torch_gcu's transfer_to_gcu makes "
                                 "torch.cuda answer for GCUs), not Iluvatar CoreX"),
    ("BI-V150", "cpu", True, "torch build has no CUDA-compatible device support"),
])
def test_only_a_corex_stack_is_taken_for_iluvatar(card, flavor, ixsmi, expected):
    availability = emulated(card, flavor=flavor, ixsmi=ixsmi).availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


def test_a_kunlun_cuda_torch_is_not_taken_for_iluvatar(monkeypatch):
    monkeypatch.setattr(vendors, "installed", lambda module: module == "torch_xmlir")
    availability = emulated("BI-V150", flavor="corex-plain").availability()
    assert availability.reason == "this is a Kunlunxin stack (torch_xmlir is installed), not Iluvatar CoreX"


@pytest.mark.parametrize("flavor,identified_by", [
    ("corex", "torch.corex"),
    ("corex-plain", "ixsmi (ixsmi: 8 devices)"),     # FlagGems' fallback: the query tool runs
])
def test_corex_is_identified_by_its_marker_or_by_ixsmi(flavor, identified_by):
    backend = emulated(flavor=flavor)
    assert backend.availability().available, backend.availability().reason
    assert backend.versions()["identified by"] == identified_by
    assert backend.versions()["chip"] == f"Iluvatar BI-V150 ({identified_by})"


def fake_torch(**attributes) -> types.SimpleNamespace:
    version = types.SimpleNamespace(hip=attributes.pop("hip", None), cuda=attributes.pop("cuda", None))
    return types.SimpleNamespace(version=version, **attributes)


def test_cuda_flavor_keys_on_the_attribute_as_flagGems_does():
    # FlagGems: hasattr(torch, "corex"), whatever the attribute holds
    assert vendors.cuda_flavor(fake_torch(__version__="2.7.1", cuda="10.2", corex=types.ModuleType("corex"))) == \
        "iluvatar"
    assert vendors.cuda_flavor(fake_torch(__version__="2.7.1+corex.4.4.0", cuda="10.2")) == "iluvatar"
    assert vendors.cuda_flavor(fake_torch(__version__="2.9.0", cuda="12.8")) == "cuda"


def test_the_real_runtime_reads_the_torch_attributes_and_runs_no_tool_for_a_marked_build(monkeypatch):
    monkeypatch.setattr(IluvatarRuntime, "query_tool", staticmethod(lambda: pytest.fail("ixsmi must not run")))
    torch_module = fake_torch(__version__="2.4.1+corex.4.2.0", cuda="10.2", corex=True)
    backend = IluvatarBackend(runtime=IluvatarRuntime(torch_module), name="probe", device_type="cpu")
    availability = backend.availability()
    assert availability.reason == "torch 2.4.1+corex.4.2.0 is too old: glm5_hal needs torch >= 2.6"


def test_the_query_tool_is_looked_up_on_path(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert run_query_tool() == (False, "ixsmi not found on PATH")


def test_probe_gives_a_specific_reason_without_devices():
    availability = emulated(devices=0).availability()
    assert availability.reason == ("no CoreX GPU visible (torch.cuda.device_count() == 0; check `ixsmi` and "
                                   "CUDA_VISIBLE_DEVICES)")


@pytest.mark.parametrize("card,product", [("BI-V150", "BI-V150"), ("MR-V100", "MR-V100")])
def test_capabilities_per_product(card, product):
    backend = emulated(card)
    assert backend.availability().reason.startswith(
        f"EMULATED (IluvatarEmulator): 8 x Iluvatar {card} ({product}), torch 2.7.1+corex.4.4.0, ixformer 0.7.0")
    caps = backend.cached_capabilities()
    assert (set(caps.dtypes), caps.dist_backend) == ({F32, F16, BF16}, "nccl")
    assert caps.limits["product"] == product and caps.limits["fp64"] is False
    assert caps.limits["corex_kernels"].startswith("CoreX kernel not built")


def test_a_corex_gpu_with_another_name_is_usable(monkeypatch):
    import emulators.iluvatar as emulator
    monkeypatch.setitem(emulator.CARDS, "BI-V150", "Iluvatar XYZ")
    backend = emulated("BI-V150")
    assert "Iluvatar XYZ (not in glm5_hal's table)" in backend.availability().reason


# -- versioned behaviours ----------------------------------------------------------------------------
def test_versions_outside_the_verified_ranges_narrow_the_backend(hal_state, monkeypatch):
    backend = register(hal_state, monkeypatch, flag_gems="5.2.0", ixformer="0.8.1")
    reason = backend.availability().reason
    assert "narrowed to what is verified" in reason and "flag_gems 5.2.0 is older than 5.3.1" in reason
    assert "ixformer 0.8.1 is newer than 0.7" in reason
    x = torch.ones(3, 16, dtype=I8)
    assert rejection("int8_gemm", x, torch.ones(3), torch.ones(4, 16, dtype=I8), torch.ones(4), BF16, None) == (
        "ixformer_w8a8 unverified here: ixformer 0.8.1 is newer than 0.7, the newest version ixformer_w8a8 was "
        "verified against")
    q, k, w = torch.ones(2, 4, 8), torch.ones(5, 8), torch.ones(2, 4)
    assert "flag_gems_topk unverified here" in rejection("indexer_topk", q, k, w, torch.zeros(2, dtype=I32),
                                                         torch.full((2,), 5, dtype=I32), 3)


# -- ixformer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 129)])
def test_rms_norm_matches_the_reference(corex, dtype, shape):
    g = seeded(1)
    x, w = randn(*shape, g=g, dtype=dtype), randn(shape[-1], g=g, dtype=dtype)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"
    torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), hal.reference.rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1e-5)
    assert corex.runtime.calls["rms_norm"] == 1


def test_rms_norm_declines_float32_and_a_wider_weight(corex):
    assert rejection("rms_norm", torch.ones(2, 8), torch.ones(8), 1e-6) == (
        "implements rms_norm for {bfloat16, float16}, not float32")
    assert rejection("rms_norm", torch.ones(2, 8, dtype=F16), torch.ones(8), 1e-6) == (
        "ixformer's rms_norm takes the weight in x's dtype; casting the float32 weight to float16 would round it")
    assert corex.runtime.calls["rms_norm"] == 0


def test_without_ixformer_its_ops_decline_with_the_reason(hal_state, monkeypatch):
    register(hal_state, monkeypatch, ixformer=None)
    assert rejection("rms_norm", torch.ones(2, 8, dtype=BF16), torch.ones(8, dtype=BF16), 1e-6) == (
        "ixformer not installed (Iluvatar's op library, from the CoreX SDK)")


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_int8_quant_matches_the_reference_including_a_row_of_zeros(corex, dtype):
    x = randn(4, 3, 40, g=seeded(3), dtype=dtype)
    x[1, 2] = 0          # the kernel divides by a zero scale there: the adapter gives the contract's 0 codes
    assert chosen("int8_quant", x) == f"{EMU}.int8_quant"
    q, scale = hal.ops.int8_quant(x)
    ref_q, ref_scale = hal.reference.int8_quant(x)
    torch.testing.assert_close(scale, ref_scale)
    assert (q.int() - ref_q.int()).abs().max() <= 1 and not q[1, 2].any()
    assert corex.runtime.calls["dynamic_scaled_int8_quant"] == 1


def test_int8_quant_declines_a_row_whose_reciprocal_scale_overflows(corex):
    x = torch.ones(2, 8, dtype=BF16)
    x[1] = 1e-38
    assert "multiplies by 127 / absmax (vLLM's formula), which overflows to inf" in rejection("int8_quant", x)


def test_int8_gemm_matches_the_reference(corex):
    g = seeded(4)
    x = torch.randint(-127, 128, (5, 48), generator=g, dtype=I8)
    w = torch.randint(-127, 128, (6, 48), generator=g, dtype=I8)
    x_scale, w_scale = torch.rand(5, generator=g) / 100, torch.rand(6, generator=g) / 100
    assert chosen("int8_gemm", x, x_scale, w, w_scale, BF16, None) == f"{EMU}.int8_gemm"
    torch.testing.assert_close(hal.ops.int8_gemm(x, x_scale, w, w_scale, BF16),
                               hal.reference.int8_gemm(x, x_scale, w, w_scale, BF16), rtol=1.6e-2, atol=1e-3)
    assert corex.runtime.calls["w8a8"] == 1


def test_int8_gemm_declines_float32_out_and_a_float32_bias(corex):
    x, w = torch.ones(2, 16, dtype=I8), torch.ones(3, 16, dtype=I8)
    assert rejection("int8_gemm", x, torch.ones(2), w, torch.ones(3), F32, None) == (
        "ixformer's w8a8 writes fp16/bf16 outputs (its callers' model dtype), not float32")
    assert rejection("int8_gemm", x, torch.ones(2), w, torch.ones(3), BF16, torch.ones(3)).startswith(
        "ixformer's w8a8 takes its bias in the output dtype")


# -- FlagGems' top-k: the emulated kernel, then the indexer adapters ---------------------------------
def test_the_emulated_flaggems_topk_leaves_index_0_past_a_short_row_and_prefers_the_larger_index_on_ties():
    topk = IluvatarEmulator().top_k_per_row_prefill
    logits = torch.tensor([[1.0, 5.0, 5.0, -2.0, 0.0, 0.0], [3.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    indices = torch.full((2, 4), -7, dtype=I32)
    topk(logits, torch.tensor([0, 1], dtype=I32), torch.tensor([5, 3], dtype=I32), indices, 2, 6, 1, 4)
    assert indices.tolist() == [[2, 1, 0, 4], [0, 1, 0, 0]]   # row 1: keys 1..2 (relative 0, 1), then 0s


def test_the_emulated_flaggems_topk_refuses_a_candidate_overflow():
    topk = IluvatarEmulator().top_k_per_row_prefill
    logits = torch.ones(1, 3000)                     # every value in one bucket: 3000 candidates > 2048 slots
    with pytest.raises(RuntimeError, match="overflow the 2048-slot candidate buffer"):
        topk(logits, torch.tensor([0], dtype=I32), torch.tensor([3000], dtype=I32), torch.zeros(1, 4, dtype=I32),
             1, 3000, 1, 4)


def test_indexer_topk_matches_the_reference_with_short_rows(corex):
    g = seeded(5)
    q, k, w = randn(6, 4, 16, g=g), randn(40, 16, g=g), randn(6, 4, g=g).abs()
    starts = torch.tensor([0, 0, 5, 10, 3, 20], dtype=I32)
    ends = torch.tensor([3, 40, 9, 40, 3, 38], dtype=I32)        # rows of 3, 40, 4, 30, 0 and 18 keys
    assert chosen("indexer_topk", q, k, w, starts, ends, 8) == f"{EMU}.indexer_topk"
    got = hal.ops.indexer_topk(q, k, w, starts, ends, 8)
    expected = hal.reference.indexer_topk(q, k, w, starts, ends, 8)
    assert torch.equal(got.sort(-1).values, expected.sort(-1).values)
    assert corex.runtime.calls["top_k_per_row_prefill"] == 1


def test_indexer_topk_paged_matches_the_reference(corex):
    g = seeded(6)
    q, cache, w = randn(2, 2, 4, 16, g=g), randn(6, 4, 16, g=g), randn(2, 2, 4, g=g).abs()
    table = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=I32)
    lens = torch.tensor([5, 11], dtype=I32)
    assert chosen("indexer_topk_paged", q, cache, w, table, lens, 4) == f"{EMU}.indexer_topk_paged"
    got = hal.ops.indexer_topk_paged(q, cache, w, table, lens, 4)
    expected = hal.reference.indexer_topk_paged(q, cache, w, table, lens, 4)
    assert torch.equal(got.sort(-1).values, expected.sort(-1).values)


def test_indexer_declines_rows_longer_than_the_candidate_buffer(corex):
    q, k, w = torch.ones(1, 2, 8), torch.ones(chips.topk_candidate_slots(4) + 1, 8), torch.ones(1, 2)
    assert rejection("indexer_topk", q, k, w, torch.zeros(1, dtype=I32), torch.ones(1, dtype=I32), 4).endswith(
        "FlagGems' top_k_per_row_prefill writes a row's candidates into 2048 slots without a bound: rows of 2049 keys "
        "could overflow it")


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_silu_and_mul_runs_flaggems_fused_kernel_while_the_corex_kernels_are_not_built(corex, dtype):
    x = randn(3, 5, 34, g=seeded(8), dtype=dtype)
    assert chosen("silu_and_mul", x) == f"{EMU}.silu_and_mul"
    torch.testing.assert_close(hal.ops.silu_and_mul(x), hal.reference.silu_and_mul(x), rtol=1.6e-2, atol=1e-5)
    assert corex.runtime.calls["silu_and_mul"] == 1


def test_silu_and_mul_without_kernels_or_flaggems_says_both(hal_state, monkeypatch):
    register(hal_state, monkeypatch, flag_gems=None)
    reason = rejection("silu_and_mul", torch.ones(2, 8))
    assert reason.startswith("CoreX kernel not built") and reason.endswith(
        "; flag_gems not installed (FlagGems' fused ops)")


def test_kernel_only_ops_decline_while_the_corex_kernels_are_not_built(corex):
    assert rejection("moe_permute", torch.ones(2, 4), torch.zeros(2, 1, dtype=I32), 2).startswith(
        "CoreX kernel not built")


def test_doctor_knows_the_corex_stack():
    from glm5_hal.doctor import format_report
    report = {"python": "3", "platform": "linux", "torch": {"version": "2.7.1+corex.4.4.0", "cuda": "10.2",
                                                             "accelerator": "cuda", "stack": "iluvatar"},
              "torch_autoload_bridges": [], "glm5_hal_env": {}, "native_extension": {"openmp": True},
              "vendors": {"iluvatar": {"bridge": None, "bridge_installed": True, "toolchain_root": None,
                                       "compiler": None, "device_tool": "/usr/local/corex/bin/ixsmi", "smi": "ixsmi",
                                       "visible_devices": {"CUDA_VISIBLE_DEVICES": "0,1"}, "dist_backend": "nccl"}},
              "toolchains": {"cuda": None, "nvcc": None}, "findings": []}
    text = format_report(report)
    assert "stack: iluvatar" in text
    assert "ixsmi found" in text and "CUDA_VISIBLE_DEVICES=0,1" in text


def test_the_nvidia_backend_refuses_a_corex_torch():
    from glm5_hal.backends.cuda import CudaBackend
    corex_torch = IluvatarEmulator().torch            # torch.corex set, torch.version.cuda "10.2"
    backend = CudaBackend(runtime=types.SimpleNamespace(EMULATOR=True, torch=corex_torch, package_versions=lambda: {}),
                          name="cuda_probe", device_type="cpu")
    assert backend.availability().reason == ("this torch is an Iluvatar CoreX build (torch '+corex'): its `cuda` "
                                             "device is not NVIDIA's")


@pytest.fixture
def fake_ixformer(tmp_path, monkeypatch):
    """Installs a package `ixformer` whose inference.functions module runs `body` on import."""
    def install(body: str) -> None:
        functions = tmp_path / "ixformer" / "inference"
        functions.mkdir(parents=True)
        (tmp_path / "ixformer" / "__init__.py").write_text("")
        (functions / "__init__.py").write_text("")
        (functions / "functions.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("ixformer", "ixformer.inference", "ixformer.inference.functions"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield install
    for name in ("ixformer", "ixformer.inference", "ixformer.inference.functions"):
        sys.modules.pop(name, None)


def test_ixformer_without_the_corex_libraries_is_a_reason_not_a_crash(fake_ixformer):
    runtime = IluvatarRuntime(torch)
    assert runtime.ixformer is None
    assert runtime.ixformer_missing == "ixformer not installed (Iluvatar's op library, from the CoreX SDK)"
    fake_ixformer("raise ImportError('libexample.so.1: cannot open shared object file: No such file or directory')\n")
    runtime = IluvatarRuntime(torch)
    assert runtime.ixformer is None
    assert runtime.ixformer_missing.startswith("runtime library missing: libexample.so.1 (ixformer is installed, but "
                                               "the CoreX runtime is not on the library path")


def test_ixformer_failing_otherwise_says_how(fake_ixformer):
    fake_ixformer("raise RuntimeError('no device')\n")
    assert IluvatarRuntime(torch).ixformer_missing == (
        "importing ixformer.inference.functions failed: RuntimeError: no device")


# -- what dispatch remembers with a call key ----------------------------------------------------------
def test_a_metadata_predicate_is_remembered_with_the_call_key_and_int8_quant_checks_the_data_per_call(corex):
    """rms_norm's predicate reads dtypes and the probed ixformer only (supports_metadata): the
    adapter is remembered with the call key. int8_quant's reads the data (a row whose 127 /
    absmax overflows): the same key with such a row is declined, per call."""
    g = seeded(41)
    x, w = randn(4, 64, g=g, dtype=BF16), randn(64, g=g, dtype=BF16)
    assert remembered(hal.ops.rms_norm, x, w, 1e-6) is corex.impls["rms_norm"].fn
    hal.ops.rms_norm(x, w, 1e-6)
    assert corex.runtime.calls["rms_norm"] == 2

    x = randn(3, 40, g=g, dtype=BF16)
    assert remembered(hal.ops.int8_quant, x) is None
    assert corex.runtime.calls["dynamic_scaled_int8_quant"] == 1
    x[1] = 1e-37     # absmax below 127 / FLT_MAX: vLLM's 127 / absmax is inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hal.FallbackWarning)
        q, scale = hal.ops.int8_quant(x)
    assert same_call_key(hal.ops.int8_quant) and corex.runtime.calls["dynamic_scaled_int8_quant"] == 1
    ref_q, ref_scale = hal.reference.int8_quant(x)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
