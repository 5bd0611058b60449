"""The CUDA-dialect kernels (backends/_cuda_dialect), as far as this machine can check them:
no GPU here, and neither mcc (MUSA) nor hipcc (DCU). What is checked:

* the C ABI header and the ctypes signatures / constants agree;
* every CUDA runtime name the sources use is mapped by both vendor glue headers;
* every source compiles with nvcc for sm_90 without warnings (slow);
* the float16 / bfloat16 / FP8 bit conversions, compiled for the host with g++, equal
  torch's on every 16-bit and 8-bit pattern and on rounding ties (slow);
* the nvcc-built library loads, and every launcher's arguments pass the kernels' host-side
  size checks (the launch itself then fails for want of a device -- or, on a machine with a
  CUDA GPU, runs and is compared with the reference).
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends import _cuda_dialect as gpu
from glm5_hal.backends._cuda_dialect import GpuKernelLibrary, KernelError

from conftest import REPO, seeded

HEADER_TEXT = gpu.HEADER.read_text()
SOURCES = sorted(gpu.SOURCES.glob("*.cu"))
GLUE = {"musa": REPO / "backends/musa/csrc/glm5_hal_musa_runtime.h",
        "hip": REPO / "backends/dcu/csrc/glm5_hal_hip_runtime.h"}

_C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "const char*": ctypes.c_char_p}


def _ctype(declaration: str):
    declaration = " ".join(declaration.split())
    if "*" in declaration and not declaration.startswith("const char*"):
        return ctypes.c_void_p
    kind = declaration.rsplit(" ", 1)[0] if " " in declaration else declaration
    return _C_TYPES[kind]


def header_prototypes() -> dict[str, tuple]:
    prototypes = {}
    for match in re.finditer(r"^(const char\*|int)\s+(glm5_hal_gpu_\w+)\(([^)]*)\);", HEADER_TEXT, re.M):
        restype, name, params = match.groups()
        params = " ".join(params.split())
        argtypes = [] if params in ("", "void") else [_ctype(p.strip()) for p in params.split(",")]
        prototypes[name] = (_C_TYPES[restype], argtypes)
    return prototypes


def test_the_header_and_the_ctypes_signatures_agree():
    prototypes = header_prototypes()
    assert len(prototypes) == 10
    assert prototypes == gpu.SIGNATURES


def test_the_header_constants_and_the_python_mirrors_agree():
    def define(name):
        return int(re.search(rf"#define {name} (\d+)", HEADER_TEXT).group(1))

    def enum(name):
        return int(re.search(rf"\b{name} = (-?\d+)", HEADER_TEXT).group(1))

    assert define("GLM5_HAL_GPU_ABI_VERSION") == gpu.ABI_VERSION
    assert (define("GLM5_HAL_GPU_MLA_MAX_DQK"), define("GLM5_HAL_GPU_MLA_MAX_DV"),
            define("GLM5_HAL_GPU_INDEXER_MAX_QROW")) == (gpu.MLA_MAX_DQK, gpu.MLA_MAX_DV, gpu.INDEXER_MAX_QROW)
    assert {enum("GLM5_HAL_GPU_F32"), enum("GLM5_HAL_GPU_F16"), enum("GLM5_HAL_GPU_BF16"),
            enum("GLM5_HAL_GPU_FP8_E4M3")} == set(gpu.DTYPE_CODE.values())
    assert [gpu.DTYPE_CODE[d] for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)] == [
        enum("GLM5_HAL_GPU_F32"), enum("GLM5_HAL_GPU_F16"), enum("GLM5_HAL_GPU_BF16"), enum("GLM5_HAL_GPU_FP8_E4M3")]
    assert (enum("GLM5_HAL_GPU_OK"), enum("GLM5_HAL_GPU_EINVAL")) == (gpu.OK, gpu.EINVAL)
    kernel_heads = int(re.search(r"heads > (\d+)", (gpu.SOURCES / "indexer_topk.cu").read_text()).group(1))
    assert kernel_heads == gpu.INDEXER_MAX_HEADS


@pytest.mark.parametrize("target", sorted(GLUE))
def test_every_cuda_runtime_name_the_sources_use_is_mapped_by_the_glue(target):
    used = set()
    for path in [*SOURCES, *gpu.SOURCES.glob("*.h"), *gpu.SOURCES.glob("*.cuh")]:
        used |= set(re.findall(r"\bcuda[A-Z]\w*", path.read_text()))
    mapped = set(re.findall(r"#define (cuda\w+) ", GLUE[target].read_text()))
    assert used and used <= mapped, used - mapped


def nvcc() -> str:
    found = shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)
    if found is None:
        pytest.skip("nvcc not found: the CUDA-dialect sources cannot be compiled here")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_source_compiles_with_nvcc_without_warnings(source, tmp_path):
    result = subprocess.run(
        [nvcc(), "-c", "-std=c++17", "-O2", "-arch=sm_90", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra",
         "-I", str(gpu.HERE / "include"), "-I", str(gpu.SOURCES), "-o", str(tmp_path / "kernel.o"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


# -- numeric conversions on the host -------------------------------------------------------------
_DRIVER = r"""
#define GLM5_HAL_GPU_HOST_TEST
#include "numeric.cuh"
using namespace glm5_hal_gpu;
extern "C" {
void half_to_float(const uint16_t* in, float* out, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = half_bits_to_float(in[i]); }
void float_to_half(const float* in, uint16_t* out, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = float_to_half_bits(in[i]); }
void bf16_to_float(const uint16_t* in, float* out, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(in[i]); }
void float_to_bf16(const float* in, uint16_t* out, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16_bits(in[i]); }
void fp8_to_float(const uint8_t* in, float* out, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = fp8_e4m3_bits_to_float(in[i]); }
void keys(const float* in, uint32_t* out, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = ordered_key(in[i]); }
}
"""


@pytest.fixture(scope="module")
def numeric(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    folder = tmp_path_factory.mktemp("numeric")
    (folder / "driver.cpp").write_text(_DRIVER)
    library = folder / "libnumeric.so"
    subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
                    "-I", str(gpu.SOURCES), "-o", str(library), str(folder / "driver.cpp")], check=True, timeout=120)
    lib = ctypes.CDLL(str(library))

    def call(name, values: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        values = values.contiguous()
        out = torch.empty(values.shape, dtype=out_dtype)
        getattr(lib, name)(ctypes.c_void_p(values.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_int64(values.numel()))
        return out
    return call


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


def interesting_floats() -> torch.Tensor:
    """Every half value, the midpoints between neighbours (rounding ties), random floats over
    the whole exponent range, subnormals of both formats, overflow, inf and nan."""
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    mids = (halves[:-1].double() + halves[1:].double()).div(2).float()
    g = seeded(0)
    wide = torch.randn(200_000, generator=g) * torch.pow(2.0, torch.randint(-140, 127, (200_000,), generator=g).float())
    specials = torch.tensor([0.0, 65504.0, 65519.9, 65520.0, 1e6, 3.0e38, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26,
                             1e-45, 3.4e38, float("inf"), float("nan")])
    values = torch.cat((halves, mids, wide, specials))
    return torch.cat((values, -values))


@pytest.mark.slow
def test_16_bit_and_fp8_conversions_equal_torchs(numeric):
    all16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.uint16)
    assert same_floats(numeric("half_to_float", all16, torch.float32), all16.view(torch.float16).float())
    assert same_floats(numeric("bf16_to_float", all16, torch.float32), all16.view(torch.bfloat16).float())
    all8 = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    assert same_floats(numeric("fp8_to_float", all8, torch.float32), all8.view(torch.float8_e4m3fn).float())
    values = interesting_floats()
    for name, dtype in (("float_to_half", torch.float16), ("float_to_bf16", torch.bfloat16)):
        got = numeric(name, values, torch.uint16).view(dtype)
        want = values.to(dtype)
        equal = (got.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(got) & torch.isnan(want))
        assert bool(equal.all()), (name, values[~equal][:5], got[~equal][:5], want[~equal][:5])


@pytest.mark.slow
def test_ordered_keys_sort_like_the_floats(numeric):
    values = torch.cat((interesting_floats(), torch.tensor([float("-inf"), -0.0])))
    values = values[~torch.isnan(values)]
    keys = numeric("keys", values, torch.int32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    order = torch.argsort(keys, stable=True)
    assert bool((values[order][1:] >= values[order][:-1]).all())
    negative_zero, positive_zero = numeric("keys", torch.tensor([-0.0, 0.0]), torch.int32).view(torch.int32).tolist()
    assert (negative_zero & 0xFFFFFFFF) < (positive_zero & 0xFFFFFFFF)


# -- the library the nvcc build installed ----------------------------------------------------------
def test_a_missing_library_is_a_reason_not_an_error(tmp_path):
    library = GpuKernelLibrary(tmp_path / "libnothing.so", label="MUSA kernel", target="musa", hint="build it")
    assert library.missing() == f"MUSA kernel not built (libnothing.so not found in {tmp_path}; build it)"
    with pytest.raises(KernelError, match="MUSA kernel not built"):
        library.silu_and_mul(torch.ones(2, 4), 0)


@pytest.fixture(scope="module")
def cuda_build() -> GpuKernelLibrary:
    library = GpuKernelLibrary(gpu.cuda_library(), label="CUDA kernel", target="cuda", hint="install with nvcc")
    if library.missing():
        pytest.skip(f"the nvcc build is not usable: {library.missing()}")
    return library


def test_the_cuda_build_loads_and_a_library_of_another_target_is_refused(cuda_build):
    assert cuda_build.status() == "built (libglm5_hal_cuda_kernels.so)"
    other = GpuKernelLibrary(cuda_build.path, label="MUSA kernel", target="musa", hint="")
    assert other.missing() == ("MUSA kernel library libglm5_hal_cuda_kernels.so was built for cuda (ABI 1), "
                               "expected musa (ABI 1); rebuild glm5_hal")


def _launches(g, device):
    """One call per launcher with small valid inputs, and the reference result."""
    mla_q, mla_kv = torch.randn(2, 3, 4, 96, generator=g), torch.randn(5, 16, 96, generator=g)
    table, lens = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32), torch.tensor([20, 7], dtype=torch.int32)
    mla_idx = torch.randint(-1, 24, (2, 3, 9), generator=g, dtype=torch.int32)
    iq, ik, iw = torch.randn(4, 2, 32, generator=g), torch.randn(12, 32, generator=g), torch.rand(4, 2, generator=g)
    starts, ends = torch.tensor([0, 2, 5, 12], dtype=torch.int32), torch.tensor([3, 12, 5, 12], dtype=torch.int32)
    pq, pk, pw = torch.randn(2, 3, 2, 32, generator=g), torch.randn(5, 16, 32, generator=g), torch.rand(2, 3, 2,
                                                                                                       generator=g)
    x = torch.randn(3, 10, generator=g, dtype=torch.float32).to(torch.bfloat16)
    cache, values, slots = torch.zeros(2, 4, 8), torch.randn(3, 8, generator=g), torch.tensor([5, -1, 0])
    mx, ids = torch.randn(5, 12, generator=g), torch.randint(-1, 4, (5, 3), generator=g, dtype=torch.int32)
    routing = torch.rand(5, 3, generator=g)
    _, _, src = hal.reference.moe_permute(mx, ids, 4)
    my = torch.randn(src.shape[0], 12, generator=g)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return {
        "sparse_mla_decode": (lambda k, s: k.sparse_mla_decode(*to(mla_q, mla_kv, table, lens, mla_idx), 0.1, 64, s),
                              hal.reference.sparse_mla_decode_paged(mla_q, mla_kv, table, lens, mla_idx, 0.1, 64)),
        "indexer_topk": (lambda k, s: k.indexer_topk(*to(iq, ik), None, *to(iw, starts, ends), 4, s),
                         hal.reference.indexer_topk(iq, ik, iw, starts, ends, 4)),
        "indexer_topk_paged": (lambda k, s: k.indexer_topk_paged(*to(pq, pk), None, *to(pw, table, lens), 4, s),
                               hal.reference.indexer_topk_paged(pq, pk, pw, table, lens, 4)),
        "silu_and_mul": (lambda k, s: k.silu_and_mul(x.to(device), s), hal.reference.silu_and_mul(x)),
        "kv_cache_write": (lambda k, s: k.kv_cache_write(*to(cache, values, slots), s), None),
        "moe_permute": (lambda k, s: k.moe_permute(*to(mx, ids), 4, s), hal.reference.moe_permute(mx, ids, 4)),
        "moe_unpermute": (lambda k, s: k.moe_unpermute(*to(my, src, routing), s),
                          hal.reference.moe_unpermute(my, src, routing)),
    }


@pytest.mark.parametrize("launcher", ["sparse_mla_decode", "indexer_topk", "indexer_topk_paged", "silu_and_mul",
                                      "kv_cache_write", "moe_permute", "moe_unpermute"])
def test_every_launcher_passes_the_kernels_size_checks(cuda_build, launcher):
    """Here (no GPU) the host code accepts the arguments and only the launch fails; on a
    machine with a CUDA GPU the kernel runs and its result is compared."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    call, want = _launches(seeded(12), device)[launcher]
    if device == "cpu":
        with pytest.raises(KernelError, match=r"launch failed with runtime error \d+"):
            call(cuda_build, 0)
        return
    got = call(cuda_build, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    if launcher.startswith("indexer"):
        assert torch.equal(got.cpu().sort(-1).values, want.sort(-1).values)
    elif launcher == "moe_permute":
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    elif launcher == "sparse_mla_decode":
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-4, atol=1e-5)
    elif want is not None:
        torch.testing.assert_close(got.cpu(), want)


def test_sizes_beyond_the_kernels_limits_are_refused_before_any_launch(cuda_build):
    q, kv = torch.zeros(1, 1, 1, gpu.MLA_MAX_DQK + 1), torch.zeros(1, 4, gpu.MLA_MAX_DQK + 1)
    table, lens, idx = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, 1,
                                                                                                          dtype=torch.int32)
    with pytest.raises(KernelError, match=r"refused by the kernel's size checks \(EINVAL\)"):
        cuda_build.sparse_mla_decode(q, kv, table, lens, idx, 0.1, 64, 0)
    with pytest.raises(KernelError, match="EINVAL"):
        cuda_build.sparse_mla_decode(q[..., :64], kv[..., :64], table, lens, idx, float("inf"), 64, 0)
