"""The NVIDIA cuda backend, as far as a machine without a GPU can check it:

* probe reasons (CPU build, ROCm / DCU / Kunlun / Iluvatar torch, old torch, no device, an
  sm_75 GPU) and capabilities per compute capability;
* versioned behaviours: FlashMLA's interface read from its source without importing it, an
  unverified FlashMLA / DeepGEMM / torch narrowing only what depends on it;
* every adapter end to end against tests/emulators/cuda.py (FlashMLA in both interface
  generations, torch's CUDA ops) on CPU tensors, compared with glm5_hal.reference; calls
  outside a library's constraints declined with a reason, never reaching the library;
* no adapter reads device data back (a Tensor method that would synchronise a GPU is caught);
* the nvcc build installed here holds SASS for every target architecture and PTX for the newest;
* (slow) the conformance suite on the emulated backend with the real kernels on the CPU
  simulator of the CUDA dialect (tests/emulators/cuda_sim).
Nothing here ran on a GPU: scripts/gpu_check.sh does that on a machine with one.
"""
from __future__ import annotations

import collections
import functools
import math
import os
import shutil
import struct
import sys
import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends.cuda import CudaBackend, arch
from glm5_hal.backends.cuda import runtime as cuda_runtime
from glm5_hal.backends.cuda.kernels import cuda_kernels
from emulators.cuda import CudaEmulator, CudaOpError
from no_sync import DEVICE_TYPE, device_runtime, to_device, to_host, watch

from conftest import REPO, seeded
from emulated_helpers import (as_plugin, declined_reason, randn, register_emulated, remembered, same_call_key,
                              verdict)

EMU = "cuda_emu"
F32, F16, BF16, I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
GLM5_SCALE = 256 ** -0.5
rejection = functools.partial(declined_reason, EMU)


def emulated(gpu: str = "H200", kernels=None, **runtime_kwargs) -> CudaBackend:
    """An emulated cuda backend on CPU tensors; without `kernels` its kernel library is absent
    (the nvcc build installed here cannot take CPU pointers)."""
    library = kernels or cuda_kernels(REPO / "build" / "no-such-dir" / "libglm5_hal_cuda_kernels.so")
    return CudaBackend(runtime=CudaEmulator(gpu, **runtime_kwargs), name=EMU, device_type="cpu", priority=1000,
                       kernel_library=library)


def register(hal_state, monkeypatch, gpu: str = "H200", kernels=None, **runtime_kwargs) -> CudaBackend:
    return register_emulated(hal_state, monkeypatch, emulated(gpu, kernels, **runtime_kwargs))


@pytest.fixture
def h200(hal_state, monkeypatch) -> CudaBackend:
    return register(hal_state, monkeypatch, "H200")


# -- probe -----------------------------------------------------------------------------------------
def test_on_this_cpu_build_of_torch_the_registered_backend_says_why_it_is_unavailable():
    row = next(r for r in hal.backends() if r.name == "cuda")
    assert (row.available, row.device_type) == (False, "cuda")
    assert row.reason == (f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): install a CUDA "
                          "build of torch to use NVIDIA GPUs")
    assert "sparse_mla_decode_paged" in row.ops


class FakeTorch(types.SimpleNamespace):
    """A torch module as cuda_flavor sees it, for the probe's first step."""


def _runtime_with(torch_module):
    return types.SimpleNamespace(EMULATOR=True, torch=torch_module, package_versions=lambda: {})


@pytest.mark.parametrize("attributes, reason", [
    (dict(version=types.SimpleNamespace(cuda=None, hip="6.3")),
     "this torch is an AMD ROCm build (torch.version.hip = 6.3): its `cuda` device is not NVIDIA's"),
    (dict(version=types.SimpleNamespace(cuda=None, hip="6.3"), __hcu_version__="2.5"),
     "this torch is Hygon's DCU build (torch.__hcu_version__ is set): the dcu backend serves it"),
    (dict(version=types.SimpleNamespace(cuda="12.4", hip=None), __version__="2.5.0+corex", corex=True),
     "this torch is an Iluvatar CoreX build (torch '+corex'): its `cuda` device is not NVIDIA's"),
    (dict(version=types.SimpleNamespace(cuda="12.4", hip=None), __version__="2.4.1+cu124"),
     "torch 2.4.1+cu124 is too old: glm5_hal needs torch >= 2.6"),
])
def test_the_probe_names_the_stack_that_is_not_nvidia(attributes, reason):
    attributes.setdefault("__version__", "2.11.0")
    backend = CudaBackend(runtime=_runtime_with(FakeTorch(**attributes)), name=EMU, device_type="cpu")
    assert backend.availability().reason == reason


def test_a_kunlun_stack_is_left_to_the_kunlun_backend(monkeypatch):
    monkeypatch.setattr("glm5_hal.vendors.installed", lambda module: module == "torch_xmlir")
    fake = FakeTorch(version=types.SimpleNamespace(cuda="11.8", hip=None), __version__="2.1.0+cu118")
    backend = CudaBackend(runtime=_runtime_with(fake), name=EMU, device_type="cpu")
    assert backend.availability().reason == ("this torch is a Kunlunxin stack (torch_xmlir is installed): the "
                                             "kunlun backend serves its `cuda` device")


def test_no_visible_gpu_and_an_sm75_gpu_are_reasons():
    assert emulated(devices=0).availability().reason == (
        "no CUDA device visible (torch.cuda.device_count() == 0; check `nvidia-smi` and CUDA_VISIBLE_DEVICES)")
    assert emulated("T4").availability().reason == (
        "unsupported GPU Tesla T4: sm_75; the cuda backend's kernels need sm_80 or newer (bf16), and nvcc 13 "
        "builds nothing below sm_75")


@pytest.mark.parametrize("gpu, fp8, kernel_code, features", [
    ("A100", False, "sm_80 SASS", dict(tma=False, wgmma=False, tcgen05=False)),
    ("L40S", True, "sm_80 SASS", dict(tma=False, wgmma=False, tcgen05=False)),
    ("H200", True, "sm_90 SASS", dict(tma=True, wgmma=True, tcgen05=False)),
    ("B200", True, "sm_100 SASS", dict(tma=True, wgmma=False, tcgen05=True)),
    ("RTX5090", True, "compute_100 PTX (JIT by the driver)", dict(tma=True, wgmma=False, tcgen05=False)),
])
def test_capabilities_follow_the_compute_capability(gpu, fp8, kernel_code, features):
    backend = emulated(gpu)
    avail = backend.availability()
    assert avail.available and avail.reason.startswith(f"EMULATED (CudaEmulator): 8 x {backend.chip.device_name}")
    caps = backend.capabilities()
    assert (torch.float8_e4m3fn in caps.dtypes) == fp8 and torch.bfloat16 in caps.dtypes
    assert caps.dist_backend == "nccl"
    assert caps.limits["kernel_code"] == kernel_code
    assert {k: caps.limits[k] for k in features} == features
    assert ("peak_bf16_tflops" in caps.limits) == (gpu == "H200")


def test_the_h200_roofline_constants_and_the_versions_reported():
    backend = emulated("H200", flash_mla=2, deep_gemm="2.3.0")
    backend.availability()
    limits = backend.capabilities().limits
    assert (limits["peak_bf16_tflops"], limits["peak_hbm_tbps"], limits["multiprocessors"]) == (989.4, 4.8, 132)
    versions = backend.versions()
    assert versions["flash_mla_interface"] == "2" and versions["deep_gemm"] == "2.3.0"
    assert versions["chip"] == "NVIDIA H200 (sm_90)" and versions["torch"] == "2.11.0+cu130"
    assert limits["versioned"]["flash_mla_sparse_lse_base"] == math.e


# -- versioned behaviours --------------------------------------------------------------------------
def test_the_flash_mla_interface_generation_is_told_by_the_parameters():
    level = cuda_runtime.interface_level
    assert level(["q", "kv", "indices", "sm_scale", "d_v"]) == "1"
    assert level(["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length"]) == "2"
    assert level(["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length", "extra"]) == "3"
    assert level(["q", "kv", "indices"]) == "3"


def test_the_flash_mla_generations_are_stated_with_the_commits_that_bound_them():
    """Generation 1 runs to 1408756 (the parent of 082094b, which added attn_sink / topk_length),
    not to 48c6dc4^ (c741387, already generation 2): the README and arch.py say so."""
    assert arch.FLASH_MLA_INTERFACE_COMMITS == {1: ("c28eca9", "1408756"), 2: ("082094b", "9241ae3")}
    readme = (REPO / "backends" / "cuda" / "README.md").read_text()
    source = (REPO / "backends" / "cuda" / "arch.py").read_text()
    for generation, (first, last) in arch.FLASH_MLA_INTERFACE_COMMITS.items():
        assert f"generation {generation} ({first} .. {last})" in readme
        assert f"{first} .. {last}" in source
    assert "48c6dc4^" not in readme and "48c6dc4^" not in source


def test_the_flash_mla_interface_is_read_from_its_source_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "flash_mla"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('the CUDA extension must not be loaded by a probe')\n")
    (package / "flash_mla_interface.py").write_text(
        "def get_mla_metadata(*args, **kwargs):\n    pass\n\n"
        "def flash_mla_sparse_fwd(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None,\n"
        "                         topk_length=None):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cuda_runtime.flash_mla_interface_parameters() == list(arch.FLASH_MLA_INTERFACES[1])
    versions = cuda_runtime.CudaRuntime(torch).package_versions()
    assert versions["flash_mla_interface"] == "2" and "flash_mla" not in sys.modules


def test_an_unverified_flash_mla_narrows_only_the_sparse_attention_adapters():
    backend = emulated("H200")
    backend.runtime.package_versions = lambda: {"flash_mla": "1.0.0+abcdef0", "flash_mla_interface": "3"}
    avail = backend.availability()
    assert avail.available and "narrowed to what is verified (flash_mla_sparse_lse_base: flash_mla_interface 3 " \
                                "is newer than 2, the newest version flash_mla_sparse_lse_base was verified " \
                                "against" in avail.reason
    g = seeded(1)
    q, kv = randn(2, 64, 576, g=g, dtype=BF16), randn(40, 576, g=g, dtype=BF16)
    idx = torch.randint(0, 40, (2, 128), generator=g, dtype=I32)
    reason = verdict(backend.impls["sparse_mla_attention"], q, kv, idx, GLM5_SCALE, 512)
    assert reason.startswith("FlashMLA: flash_mla_sparse_lse_base unverified here: flash_mla_interface 3 is newer")
    assert verdict(backend.impls["rms_norm"], q, torch.ones(576, dtype=BF16), 1e-6) is True


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.0+cu130", "2.13.0+cu130", "2.14.1+cu130", "2.15.0+cu132"])
def test_the_torch_op_behaviours_are_verified_from_2_11_to_2_15(version):
    """Read from each minor version's wheel (backends/cuda/arch.py: the schemas, the messages and
    the compiled conditions are unchanged), so the pinned 2.13 and its successors keep the
    adapters."""
    backend = emulated("H200", torch_version=version)
    assert "narrowed" not in backend.availability().reason
    x = torch.ones(4, 64, dtype=BF16)
    assert verdict(backend.impls["rms_norm"], x, torch.ones(64, dtype=BF16), 1e-6) is True
    for behaviour in (arch.TORCH_GROUPED_MM, arch.TORCH_SCALED_MM_BLOCKWISE, arch.TORCH_FUSED_RMS_NORM):
        assert backend.unverified(behaviour.name) is None


def test_a_torch_newer_than_2_15_narrows_the_torch_op_adapters():
    backend = emulated("H200", torch_version="2.16.0+cu132")
    assert "torch_grouped_mm_fast_path: torch 2.16.0+cu132 is newer than 2.15" in backend.availability().reason
    x = torch.ones(4, 64, dtype=BF16)
    assert verdict(backend.impls["rms_norm"], x, torch.ones(64, dtype=BF16), 1e-6) == (
        "torch_fused_rms_norm unverified here: torch 2.16.0+cu132 is newer than 2.15, the newest version "
        "torch_fused_rms_norm was verified against")


def test_absent_libraries_narrow_nothing_and_their_adapters_say_not_installed():
    backend = emulated("H200", flash_mla=None, deep_gemm=None)
    assert "narrowed" not in backend.availability().reason
    g = seeded(2)
    q, kv = randn(2, 64, 576, g=g, dtype=BF16), randn(40, 576, g=g, dtype=BF16)
    idx = torch.randint(0, 40, (2, 128), generator=g, dtype=I32)
    assert verdict(backend.impls["sparse_mla_attention"], q, kv, idx, GLM5_SCALE, 512) == (
        "FlashMLA: flash_mla not installed (FlashMLA, built from github.com/deepseek-ai/FlashMLA); CUDA kernel not "
        f"built (libglm5_hal_cuda_kernels.so not found in {REPO / 'build' / 'no-such-dir'}; rebuild glm5_hal with "
        "nvcc on PATH or CUDA_HOME set (GLM5_HAL_WITH_CUDA))")


# -- on an emulated device: no host reads (tests/no_sync.py) ------------------------------------------
def register_on_device(hal_state, gpu: str = "H200", kernels=None, **runtime_kwargs) -> CudaBackend:
    """The emulated backend on the no-sync harness's device: the emulator (and a simulated
    kernel library's C code) is device code; the adapters and launchers must read nothing."""
    library = kernels or cuda_kernels(REPO / "build" / "no-such-dir" / "libglm5_hal_cuda_kernels.so")
    backend = CudaBackend(runtime=device_runtime(CudaEmulator(gpu, **runtime_kwargs)), name=EMU,
                          device_type=DEVICE_TYPE, priority=1000, kernel_library=library)
    hal_state(as_plugin(backend), EMU)
    assert backend.availability().available, backend.availability().reason
    return backend


def on_device(backend: CudaBackend, op: str, *args, reads: int = 0):
    """hal.ops.<op> on device tensors: asserts the backend's own implementation ran, that no
    host read happened outside device code (`reads` expected ones) and that the emulated
    libraries made no sync of their own; returns the host result."""
    device_args = to_device(args)
    syncs_before, fallbacks = backend.runtime.host_syncs, hal.fallback_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hal.FallbackWarning)  # the backend itself must serve the call
        with watch() as syncs:
            out = getattr(hal.ops, op)(*device_args)
    assert hal.fallback_stats() == fallbacks
    assert len(syncs) == reads, syncs.report()
    assert backend.runtime.host_syncs == syncs_before, "an emulated library call synchronised"
    return to_host(out)


# -- torch's CUDA ops ---------------------------------------------------------------------------------
def test_rms_norm_runs_the_fused_kernel_and_declines_a_weight_it_would_round(hal_state):
    backend = register_on_device(hal_state, "H200")
    g = seeded(3)
    x, w = randn(5, 7, 96, g=g, dtype=BF16), randn(96, g=g, dtype=BF16)
    got = on_device(backend, "rms_norm", x, w, 1e-6)
    torch.testing.assert_close(got, hal.reference.rms_norm(x, w, 1e-6))
    assert backend.runtime.calls["rms_norm"] == 1
    assert rejection("rms_norm", *to_device((x, w.float(), 1e-6))) == (
        "torch.rms_norm's fused CUDA kernel takes the weight in x's dtype; casting the float32 weight to bfloat16 "
        "would round it")


def test_grouped_gemm_takes_the_cutlass_path_only(hal_state, monkeypatch):
    g = seeded(4)
    counts = torch.tensor([3, 0, 5, 1], dtype=I32)
    x, w = randn(9, 40, g=g, dtype=BF16), randn(4, 24, 40, g=g, dtype=BF16)
    backend = register_on_device(hal_state, "H200")
    got = on_device(backend, "grouped_gemm", x, w, counts)
    torch.testing.assert_close(got, hal.reference.grouped_gemm(x, w, counts), rtol=1.6e-2, atol=1e-2)
    assert verdict(backend.impls["grouped_gemm"], x.half(), w.half(), counts) == (
        "torch._grouped_mm runs float16 as one mm per group after copying the offsets to the host (a device sync "
        "per call); its CUTLASS path takes bf16")
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch, "A100")
    assert rejection("grouped_gemm", x, w, counts) == (
        "torch._grouped_mm's CUTLASS path runs on sm_90 and sm_100; on sm_80 it loops per group after copying the "
        "offsets to the host (a device sync per call)")


# -- FlashMLA --------------------------------------------------------------------------------------
def _sparse_case(g, tokens, heads, topk, keys=300, dtype=BF16):
    q = randn(tokens, heads, 576, g=g, dtype=dtype, scale=0.5)
    kv = randn(keys, 576, g=g, dtype=dtype)
    idx = torch.randint(-2, keys + 3, (tokens, topk), generator=g, dtype=I32)  # some invalid entries
    idx[0, :5] = 7            # duplicates count per occurrence
    idx[-1] = -1              # a row without a valid index
    return q, kv, idx


def _close_to_reference(out, lse, ref_out, ref_lse):
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gpu, interface", [("H200", 1), ("H200", 2), ("B200", 2)])
@pytest.mark.parametrize("heads", [16, 64, 100, 130])
def test_sparse_mla_attention_through_flash_mla_sparse_fwd(hal_state, monkeypatch, gpu, interface, heads):
    """Heads padded to 64 / 128 or run in chunks, top-k padded to 128 with -1, the lse base of
    the interface converted, rows without a valid index out 0 and lse -inf."""
    backend = register_on_device(hal_state, gpu, flash_mla=interface)
    q, kv, idx = _sparse_case(seeded(5), 3, heads, 200)
    out, lse = on_device(backend, "sparse_mla_attention", q, kv, idx, GLM5_SCALE, 512)
    _close_to_reference(out, lse, *hal.reference.sparse_mla_attention(q, kv, idx, GLM5_SCALE, 512))
    assert bool((lse[-1] == -math.inf).all()) and bool((out[-1] == 0).all())
    chunks = 1 if heads <= 128 else 2
    assert backend.runtime.calls["flash_mla_sparse_fwd"] == chunks


def test_sparse_mla_decode_paged_through_flash_mla_over_the_flattened_cache(hal_state, monkeypatch):
    backend = register_on_device(hal_state, "H200", flash_mla=1)
    g = seeded(6)
    cache = randn(7, 16, 576, g=g, dtype=BF16)
    table = torch.tensor([[6, 2, 0, 4], [1, 5, -1, -1]], dtype=I32)
    lens = torch.tensor([50, 20], dtype=I32)
    q = randn(2, 2, 64, 576, g=g, dtype=BF16, scale=0.5)
    idx = torch.randint(-1, 60, (2, 2, 130), generator=g, dtype=I32)   # past the context: invalid
    idx[1, 1] = torch.arange(20, 150, dtype=I32)                       # nothing valid for this query
    args = (q, cache, table, lens, idx, GLM5_SCALE, 512)
    out, lse = on_device(backend, "sparse_mla_decode_paged", *args)
    _close_to_reference(out, lse, *hal.reference.sparse_mla_decode_paged(*args))
    assert bool((lse[1, 1] == -math.inf).all())


def test_a_block_id_outside_the_cache_is_never_handed_to_flash_mla(hal_state, monkeypatch):
    """glm5_hal.ops checks block tables on CPU tensors only; on a GPU the adapter masks a
    block id outside the cache on the device, as the kernels do."""
    from glm5_hal.backends._cuda_dialect.adapters import paged_to_physical
    table = torch.tensor([[3, 99]], dtype=I32)
    idx = torch.tensor([[[0, 17, 20, -1]]], dtype=I32)
    rows, valid = paged_to_physical(idx, table, torch.tensor([30], dtype=I32), 16, num_blocks=4)
    assert rows.tolist() == [[[48, -1, -1, -1]]] and valid.tolist() == [[[True, False, False, False]]]


def test_sparse_attention_calls_outside_flash_mla_are_declined_with_reasons(hal_state, monkeypatch):
    register(hal_state, monkeypatch, "H200", flash_mla=1)
    q, kv, idx = _sparse_case(seeded(7), 2, 64, 128)
    no_kernel = "CUDA kernel not built"
    for args, reason in [
        ((q.float(), kv.float(), idx, GLM5_SCALE, 512), "FlashMLA: flash_mla_sparse_fwd takes bfloat16 only, got "
                                                        "float32; " + no_kernel),
        ((q[..., :512], kv[..., :512], idx, GLM5_SCALE, 512), "FlashMLA: flash_mla_sparse_fwd takes (Dqk, d_v) in "
                                                              "[(576, 512)], got (512, 512); " + no_kernel),
        ((q, kv, idx, GLM5_SCALE, 448), "FlashMLA: flash_mla_sparse_fwd takes (Dqk, d_v) in [(576, 512)], got "
                                        "(576, 448); " + no_kernel),
    ]:
        assert rejection("sparse_mla_attention", *args).startswith(reason)
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch, "B200", flash_mla=1)
    assert rejection("sparse_mla_attention", q, kv, idx, GLM5_SCALE, 512).startswith(
        "FlashMLA: flash_mla_sparse_fwd (interface 1) runs on sm_90; this is sm_100")
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch, "A100")
    assert rejection("sparse_mla_attention", q, kv, idx, GLM5_SCALE, 512).startswith(
        "FlashMLA: flash_mla_sparse_fwd (interface 2) runs on sm_90 and sm_100; this is sm_80")


def test_declined_calls_never_reach_flash_mla(hal_state, monkeypatch):
    backend = register(hal_state, monkeypatch, "A100")
    q, kv, idx = _sparse_case(seeded(8), 2, 64, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hal.FallbackWarning)
        out, _ = hal.ops.sparse_mla_attention(q, kv, idx, GLM5_SCALE, 512)
    assert backend.runtime.calls["flash_mla_sparse_fwd"] == 0 and out.shape == (2, 64, 512)


def test_the_emulated_flash_mla_keeps_its_documented_constraints():
    """The emulator refuses what FlashMLA refuses, so an adapter that skipped a padding step
    would fail here rather than pass."""
    emu = CudaEmulator("H200", flash_mla=2)
    q, kv = torch.zeros(1, 48, 576, dtype=BF16), torch.zeros(4, 1, 576, dtype=BF16)
    with pytest.raises(CudaOpError, match="h_q must be 64 or 128"):
        emu.flash_mla.flash_mla_sparse_fwd(q, kv, torch.zeros(1, 1, 128, dtype=I32), 0.1)
    with pytest.raises(CudaOpError, match="topk must be a multiple of 128"):
        emu.flash_mla.flash_mla_sparse_fwd(q[:, :1].expand(1, 64, 576).contiguous(), kv,
                                           torch.zeros(1, 1, 100, dtype=I32), 0.1)


# -- DeepGEMM and torch._scaled_mm: the FP8 GEMMs -------------------------------------------------------
FP8 = torch.float8_e4m3fn


def fp8_activations(g, m, k):
    return hal.reference.fp8_block_quant(torch.randn(m, k, generator=g), 128)


def fp8_weights(g, *lead_n, k):
    """(w fp8 [..., N, K], w_scale [..., ceil(N/128), K/128]): one scale per 128 x 128 block, which
    multiplies (amax / 448, as DeepGEMM's per_block_cast_to_fp8 and the checkpoints)."""
    *lead, n = lead_n
    w = torch.randn(*lead, n, k, generator=g)
    nb = -(-n // 128)
    padded = torch.zeros(*lead, nb * 128, k)
    padded[..., :n, :] = w
    scale = padded.view(*lead, nb, 128, k // 128, 128).abs().amax(dim=(-3, -1)).clamp(min=1e-4) / 448
    full = scale.repeat_interleave(128, dim=-2)[..., :n, :].repeat_interleave(128, dim=-1)
    return (w / full).to(FP8), scale


def _gemm_close(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("deep_gemm, n, k, via", [
    ("2.1.1", 200, 256, "fp8_gemm_nt"), ("2.6.1", 136, 256, "fp8_gemm_nt"),
    (None, 208, 512, "_scaled_mm"), (None, 128, 384, "_scaled_mm")])
def test_fp8_block_gemm_through_deep_gemm_or_scaled_mm(hal_state, deep_gemm, n, k, via):
    """_scaled_mm where cuBLASLt's padded weight-scale layout equals the unpadded one torch
    takes: ceil(K/128) a multiple of 4 (K = 512), or one column of weight blocks (N = 128)."""
    backend = register_on_device(hal_state, "H200", deep_gemm=deep_gemm)
    g = seeded(11)
    (a, a_scale), (w, w_scale) = fp8_activations(g, 37, k), fp8_weights(g, n, k=k)
    got = on_device(backend, "fp8_block_gemm", a, a_scale, w, w_scale, BF16)
    _gemm_close(got, hal.reference.fp8_block_gemm(a, a_scale, w, w_scale, BF16))
    assert backend.runtime.calls[via] == 1


def test_fp8_block_gemm_calls_outside_both_are_declined_with_reasons(hal_state):
    backend = register_on_device(hal_state, "H200")
    g = seeded(12)
    (a, a_scale), (w, w_scale) = fp8_activations(g, 8, 256), fp8_weights(g, 20, k=256)
    assert verdict(backend.impls["fp8_block_gemm"], a, a_scale, w, w_scale, BF16) == (
        "DeepGEMM: DeepGEMM's TMA writes 16-byte output rows: N % 8 == 0, got N = 20; torch._scaled_mm (cuBLASLt) "
        "needs K and N multiples of 16, got K = 256, N = 20")
    (w, w_scale) = fp8_weights(g, 32, k=256)
    assert verdict(backend.impls["fp8_block_gemm"], a, a_scale, w, w_scale, F32) == (
        "DeepGEMM: DeepGEMM's sm_90 fp8_gemm_nt for 128 x 128 weight scales writes bf16 only, not float32 "
        "(sm90_fp8_gemm_1d2d); torch._scaled_mm with block scales: only a bf16 output is verified, not float32")
    b200 = emulated("B200")
    b200.availability()
    assert verdict(b200.impls["fp8_block_gemm"], a, a_scale, w, w_scale, BF16).startswith(
        "DeepGEMM: DeepGEMM on sm_100 turns float32 scales into UE8M0 powers of two")
    assert verdict(b200.impls["fp8_block_gemm"], a, a_scale, w, w_scale, BF16).endswith(
        "torch._scaled_mm's 1x128 x 128x128 scaling runs on sm_90 only; this is sm_100")


@pytest.mark.parametrize("k, n", [(640, 256), (256, 208), (1280, 384)])
def test_scaled_mm_pads_k_where_cublaslt_reads_the_weight_scales_padded(hal_state, k, n):
    """cuBLASLt reads the 128x128 weight scales with ceil(K/128) rounded up to 4 per row of weight
    blocks (the emulator reads them so); torch._scaled_mm accepts only the unpadded buffer. With
    ceil(K/128) % 4 != 0 and more than one row of weight blocks the adapter zero-pads K to a
    multiple of 512, where both layouts agree; the unpadded call (what the adapter used to make,
    made here directly) is silently wrong."""
    backend = register_on_device(hal_state, "H200", deep_gemm=None)
    g = seeded(14)
    (a, a_scale), (w, w_scale) = fp8_activations(g, 24, k), fp8_weights(g, n, k=k)
    want = hal.reference.fp8_block_gemm(a, a_scale, w, w_scale, BF16)
    _gemm_close(on_device(backend, "fp8_block_gemm", a, a_scale, w, w_scale, BF16), want)
    assert backend.runtime.calls["_scaled_mm"] == 1
    misread = CudaEmulator("H200").torch._scaled_mm(a, w.t(), a_scale.t().contiguous().t(), w_scale.t(),
                                                    out_dtype=BF16, use_fast_accum=False)
    assert not torch.allclose(misread.float(), want.float(), rtol=1.6e-2, atol=1e-2)


def test_the_emulated_scaled_mm_reads_a_padded_weight_scale_buffer_as_cublaslt_does():
    """The emulator's cuBLASLt reads row r of the weight scales at r * L4: a buffer padded the
    way PyTorch's own blockwise test pads it (_pad_128x128_scales) gives the exact product, which
    is how the emulator knows the layout (torch's v1 check itself refuses that stride)."""
    from emulators.cuda import _as_cublaslt_reads_128x128
    g = seeded(15)
    scales = torch.rand(3, 5, generator=g) + 0.5                     # [N/128, K/128], K/128 = 5
    padded = torch.nn.functional.pad(scales, (0, 3))                 # [3, 8]: L4 = 8
    torch.testing.assert_close(_as_cublaslt_reads_128x128(padded[:, :5], 5), scales)
    misread = _as_cublaslt_reads_128x128(scales, 5)
    torch.testing.assert_close(misread[0], scales[0])                # the first row is where it is
    assert not torch.equal(misread[1], scales[1]) and misread[2].isnan().any()
    aligned = torch.rand(3, 8, generator=g)
    torch.testing.assert_close(_as_cublaslt_reads_128x128(aligned, 8), aligned)


@pytest.mark.parametrize("version, reason", [
    ("2.7.0", "deep_gemm_contiguous_layout unverified here: deep_gemm 2.7.0 is newer than 2.6.1"),
    ("2.0.0", "deep_gemm_contiguous_layout unverified here: deep_gemm 2.0.0 is older than 2.1.0"),
])
def test_a_deep_gemm_outside_the_verified_versions_is_declined(version, reason):
    backend = emulated("H200", deep_gemm=version)
    assert "narrowed" in backend.availability().reason
    g = seeded(13)
    (a, a_scale), (w, w_scale) = fp8_activations(g, 8, 128), fp8_weights(g, 2, 32, k=128)
    counts = torch.tensor([8, 0], dtype=I32)
    assert verdict(backend.impls["fp8_grouped_gemm"], a, a_scale, w, w_scale, counts, BF16).startswith(reason)


@pytest.mark.parametrize("version", ["2.1.1", "2.3.0", "2.6.1"])
def test_fp8_grouped_gemm_pads_each_expert_to_deep_gemms_alignment_on_the_device(hal_state, version):
    backend = register_on_device(hal_state, "H200", deep_gemm=version)
    g = seeded(14)
    counts = torch.tensor([3, 0, 130, 1, 0, 7], dtype=I32)   # zero-row experts, one longer than a block
    (a, a_scale), (w, w_scale) = fp8_activations(g, int(counts.sum()), 256), fp8_weights(g, 6, 40, k=256)
    got = on_device(backend, "fp8_grouped_gemm", a, a_scale, w, w_scale, counts, BF16)
    _gemm_close(got, hal.reference.fp8_grouped_gemm(a, a_scale, w, w_scale, counts, BF16))
    assert backend.runtime.calls["m_grouped_fp8_gemm_nt_contiguous"] == 1


def test_the_fp8_gemms_take_nothing_to_multiply(hal_state):
    backend = register_on_device(hal_state, "H200")
    g = seeded(15)
    (w, w_scale) = fp8_weights(g, 3, 16, k=128)
    a, a_scale = torch.zeros(0, 128).to(FP8), torch.zeros(0, 1)
    got = on_device(backend, "fp8_grouped_gemm", a, a_scale, w, w_scale, torch.zeros(3, dtype=I32), BF16)
    assert got.shape == (0, 16) and backend.runtime.calls["m_grouped_fp8_gemm_nt_contiguous"] == 0


# -- the CUDA-dialect kernels, through the emulated backend (absent library) ---------------------------
def test_without_the_kernel_library_the_kernel_ops_decline_naming_it(h200):
    g = seeded(9)
    x = randn(3, 8, g=g)
    assert rejection("silu_and_mul", x).startswith("CUDA kernel not built (libglm5_hal_cuda_kernels.so not found")
    q, cache = randn(1, 1, 4, 64, g=g), randn(3, 16, 64, g=g)
    table, lens = torch.tensor([[0, 2]], dtype=I32), torch.tensor([20], dtype=I32)
    assert rejection("dense_mla_decode_paged", q, cache, table, lens, 0.1, 64).startswith("CUDA kernel not built")


# -- --ref cuda and options --------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no NVIDIA GPU")
def test_the_cuda_reference_is_float64_on_an_nvidia_gpu_and_refused_elsewhere(monkeypatch):
    from glm5_hal.conformance import runner
    assert runner.REFERENCE_MODES["cuda"] == ("cuda", torch.float64)
    with pytest.raises(hal.HalError) as refused:
        runner.check_reference_mode("cuda")
    assert str(refused.value) == (f"conformance: --ref cuda needs a CUDA device (an NVIDIA GPU), but torch "
                                  f"{torch.__version__} is a CPU build; use --ref cpu (float64 on the CPU)")
    monkeypatch.setattr("glm5_hal.vendors.cuda_flavor", lambda torch_module: "rocm")
    with pytest.raises(hal.HalError, match=r"torch's `cuda` device here is a rocm device"):
        runner.check_reference_mode("cuda")


def test_glm5_hal_cuda_disable_keeps_the_backend_off_an_installed_library(monkeypatch):
    monkeypatch.setenv("GLM5_HAL_CUDA_DISABLE", "flash_mla")
    module, reason = cuda_runtime.load_module("flash_mla", "FlashMLA", ("flash_mla_sparse_fwd",))
    assert (module, reason) == (None, "flash_mla disabled (GLM5_HAL_CUDA_DISABLE=flash_mla)")
    monkeypatch.setenv("GLM5_HAL_CUDA_DISABLE", "flashmla")
    with pytest.raises(hal.HalError, match=r"unknown library \['flashmla'\]"):
        cuda_runtime.disabled()


# -- the nvcc build ------------------------------------------------------------------------------------
def _elf_section(path, wanted: str) -> bytes:
    """The bytes of section `wanted` of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]
    for name, _, _, _, offset, size, *_ in headers:
        label = data[names[4] + name: data.index(b"\0", names[4] + name)].decode()
        if label == wanted:
            return data[offset: offset + size]
    raise AssertionError(f"{path.name} has no {wanted} section")


def fatbin_codes(path) -> collections.Counter:
    """(kind, arch) of every code image in a library's .nv_fatbin section: kind 2 is SASS (a
    cubin), 1 is PTX. The layout is what nvcc 13 writes: a header (magic 0xBA55ED50, u16
    version, u16 header size, u64 size) per compiled file, then entries (u16 kind, u16, u32
    header size, u64 payload size, ..., u32 arch at byte 28)."""
    data, offset, codes = _elf_section(path, ".nv_fatbin"), 0, collections.Counter()
    while offset + 16 <= len(data):
        magic, _, header, size = struct.unpack_from("<IHHQ", data, offset)
        if magic != 0xBA55ED50:
            offset += 8  # headers are 8-byte aligned
            continue
        entry, end = offset + header, offset + header + size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            codes[(kind, struct.unpack_from("<I", data, entry + 28)[0])] += 1
            entry += entry_header + payload
        offset = end
    return codes


def test_the_cmake_default_architectures_are_the_ones_the_backend_reports():
    text = (REPO / "backends/cuda/csrc/CMakeLists.txt").read_text()
    default = text.split('set(_glm5_hal_cuda_default "', 1)[1].split('"', 1)[0]
    assert [int(a) for a in default.split(";")] == list(arch.KERNEL_SASS) and arch.KERNEL_PTX == arch.KERNEL_SASS[-1]
    assert "-Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror" in text


def test_the_installed_cuda_library_holds_sass_for_every_target_and_ptx_for_the_newest():
    """CI builds the kernels with nvcc (make setup, warnings as errors) for every target
    architecture in one call; this reads back what the build embedded."""
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        pytest.skip("nvcc not found: GLM5_HAL_WITH_CUDA is off by default here")
    library = cuda_kernels()
    assert library.missing() is None, library.missing()
    wanted = os.environ.get("GLM5_HAL_CUDA_ARCHS")
    sass = [int(a) for a in wanted.split(";")] if wanted else list(arch.KERNEL_SASS)
    codes = fatbin_codes(library.path)
    assert {a for kind, a in codes if kind == 2} == set(sass), codes
    assert {a for kind, a in codes if kind == 1} == {sass[-1]}, codes
    sources = len(list((REPO / "backends/_cuda_dialect/src").glob("*.cu")))
    assert all(codes[(2, a)] >= sources for a in sass)


# -- the conformance suite on the emulated backend with the simulated kernels (slow) --------------------
@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    from glm5_hal.backends import _cuda_dialect as gpu
    from glm5_hal.backends._cuda_dialect import GpuKernelLibrary
    from emulators import cuda_sim
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no host C++ compiler for the kernel simulator")
    path = cuda_sim.build(gpu.HERE, tmp_path_factory.mktemp("cuda_sim"))
    return GpuKernelLibrary(path, label="simulated kernel", target="sim", hint="")


@pytest.mark.slow
def test_conformance_of_the_emulated_cuda_backend_on_the_simulated_kernels(simulated, hal_state, monkeypatch):
    """Every op the backend serves, tiny preset: each case passes through the backend's own
    implementation (bf16 sparse attention via emulated FlashMLA on the H200, the kernels on the
    simulator otherwise), is declined with a reason (fallback), or is an input the op refuses.
    FlashMLA rounds the softmax weights to bf16 before P.V (as its kernel does): the contract's
    attention slack allows exactly that (docs/conformance.md), so those cases pass too."""
    from glm5_hal.conformance import plan, run_all
    gpu = "H200"  # FlashMLA, DeepGEMM and _grouped_mm serve there; an A100's declines are checked above
    backend = register(hal_state, monkeypatch, gpu, kernels=simulated)
    records = run_all(plan([EMU], sorted(backend.impls), ["tiny"]))
    assert records
    bad = [(r.case, r.status, r.reason) for r in records if r.status not in ("pass", "fallback")]
    assert not bad, bad
    served = {r.op for r in records if r.status == "pass" and r.impl == f"{EMU}.{r.op}"}
    assert served >= {"sparse_mla_attention", "sparse_mla_decode_paged", "dense_mla_decode_paged", "indexer_topk",
                      "indexer_topk_paged", "silu_and_mul", "kv_cache_write", "moe_permute", "moe_unpermute",
                      "rms_norm"}
    assert {"grouped_gemm", "fp8_block_gemm", "fp8_grouped_gemm"} <= served
    assert all(r.reason for r in records if r.status == "fallback")
    assert backend.runtime.calls["flash_mla_sparse_fwd"] > 0


@pytest.mark.slow
def test_the_kernel_adapters_read_nothing_back_on_the_device(simulated, hal_state):
    """Every kernel-backed op on the no-sync harness's device, the simulated kernels as device
    code (their C entry points, called through ctypes): no host read in the adapters and the
    Python launchers, except moe_permute's one (its output size
    is the number of kept rows: the contract's shape is the data)."""
    backend = register_on_device(hal_state, "A100", kernels=simulated)  # the launchers are host code: watched
    g = seeded(30)
    q, kv = randn(3, 5, 96, g=g), randn(40, 96, g=g)
    idx = torch.randint(-2, 45, (3, 70), generator=g, dtype=I32)
    cache, table = randn(6, 16, 96, g=g), torch.tensor([[5, 0, 3], [2, -1, -1]], dtype=I32)
    lens = torch.tensor([40, 9], dtype=I32)
    dq, didx = randn(2, 2, 5, 96, g=g), torch.randint(-1, 42, (2, 2, 70), generator=g, dtype=I32)
    # positive queries and keys: no relu(...) = 0 ties at the k-th logit, so the sets are unique
    iq, ik, iw = randn(4, 2, 32, g=g).abs(), randn(50, 32, g=g).abs(), torch.rand(4, 2, generator=g)
    starts, ends = torch.tensor([0, 3, 10, 49], dtype=I32), torch.tensor([50, 3, 40, 50], dtype=I32)
    pq, pk, pw = randn(2, 2, 2, 32, g=g).abs(), randn(6, 16, 32, g=g).abs(), torch.rand(2, 2, 2, generator=g)
    x, ids = randn(6, 24, g=g, dtype=BF16), torch.randint(-1, 5, (6, 3), generator=g, dtype=I32)
    calls = {
        "sparse_mla_attention": (q, kv, idx, 0.1, 64),
        "sparse_mla_decode_paged": (dq, cache, table, lens, didx, 0.1, 64),
        "dense_mla_decode_paged": (dq, cache, table, lens, 0.1, 64),
        "indexer_topk": (iq, ik, iw, starts, ends, 7),
        "indexer_topk_paged": (pq, pk, pw, table, lens, 7),
        "silu_and_mul": (x,),
        "moe_unpermute": (randn(9, 24, g=g, dtype=BF16), torch.tensor([0, 4, 7, 2, 9, 11, 13, 16, 17], dtype=I32),
                          torch.rand(6, 3, generator=g)),
    }
    for op, args in calls.items():
        got, want = on_device(backend, op, *args), getattr(hal.reference, op)(*args)
        if op.startswith("indexer"):
            assert torch.equal(got.sort(-1).values, want.sort(-1).values), op
        else:
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-4, msg=op)
    got = on_device(backend, "moe_permute", x, ids, 5, reads=1)
    assert all(torch.equal(a, b) for a, b in zip(got, hal.reference.moe_permute(x, ids, 5)))
    written, expected = torch.zeros(6, 16, 96), torch.zeros(6, 16, 96)
    slots = torch.tensor([70, -1, 3], dtype=torch.int64)
    on_device(backend, "kv_cache_write", written, kv[:3], slots)
    hal.reference.kv_cache_write(expected, kv[:3], slots)
    assert torch.equal(written, expected)


# -- what dispatch remembers with a call key ----------------------------------------------------------
def test_a_metadata_predicate_is_remembered_with_the_call_key_and_flash_decode_checks_the_cache_per_call(
        hal_state, monkeypatch):
    """rms_norm's predicate reads dtypes and the probed versions only (supports_metadata): the
    adapter is remembered with the call key. FlashMLA's decode reads whether the cache is
    contiguous, which the key does not hold (only whether it is paged): a block-strided page
    view with the key of a contiguous cache is declined, per call."""
    backend = register(hal_state, monkeypatch, "H200", flash_mla=1)
    g = seeded(41)
    x, w = randn(5, 96, g=g, dtype=BF16), randn(96, g=g, dtype=BF16)
    assert remembered(hal.ops.rms_norm, x, w, 1e-6) is backend.impls["rms_norm"].fn
    hal.ops.rms_norm(x, w, 1e-6)
    assert backend.runtime.calls["rms_norm"] == 2

    cache = randn(7, 16, 576, g=g, dtype=BF16)
    table, lens = torch.tensor([[6, 2, 0, 4], [1, 5, -1, -1]], dtype=I32), torch.tensor([50, 20], dtype=I32)
    q = randn(2, 2, 64, 576, g=g, dtype=BF16, scale=0.5)
    idx = torch.randint(-1, 60, (2, 2, 130), generator=g, dtype=I32)
    decode = hal.ops.sparse_mla_decode_paged
    assert remembered(decode, q, cache, table, lens, idx, GLM5_SCALE, 512) is None
    served = backend.runtime.calls["flash_mla_sparse_fwd"]
    assert served > 0
    page_view = torch.zeros(7, 16 * 576 + 64, dtype=BF16)[:, :16 * 576].view(7, 16, 576)
    page_view.copy_(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hal.FallbackWarning)
        out, lse = decode(q, page_view, table, lens, idx, GLM5_SCALE, 512)
    assert same_call_key(decode) and backend.runtime.calls["flash_mla_sparse_fwd"] == served
    _close_to_reference(out, lse, *hal.reference.sparse_mla_decode_paged(q, cache, table, lens, idx, GLM5_SCALE, 512))


@pytest.mark.slow
def test_the_shared_kernel_adapters_remember_metadata_verdicts_and_check_the_cache_layout_per_call(
        simulated, hal_state, monkeypatch):
    """The CUDA-dialect adapters (backends/_cuda_dialect): silu_and_mul's predicate (is the
    kernel library loaded) is remembered with the call key; kv_cache_write's reads the cache's
    contiguity, which the key does not hold, so a block-strided page view with the key of a
    contiguous cache is declined, per call."""
    backend = register(hal_state, monkeypatch, "A100", kernels=simulated)
    g = seeded(42)
    assert remembered(hal.ops.silu_and_mul, randn(6, 24, g=g)) is backend.impls["silu_and_mul"].fn
    values, slots = randn(3, 96, g=g), torch.tensor([70, -1, 3], dtype=torch.int64)
    expected = torch.zeros(6, 16, 96)
    hal.reference.kv_cache_write(expected, values, slots)
    write = hal.ops.kv_cache_write
    cache = torch.zeros(6, 16, 96)
    assert remembered(write, cache, values, slots) is None and torch.equal(cache, expected)
    page_view = torch.zeros(6, 16 * 96 + 32)[:, :16 * 96].view(6, 16, 96)
    assert rejection("kv_cache_write", page_view, values, slots) == (
        "the kv_cache_write kernel writes a contiguous cache")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hal.FallbackWarning)
        write(page_view, values, slots)
    assert same_call_key(write) and torch.equal(page_view, expected)
