"""The CUDA-dialect kernels (backends/_cuda_dialect), as far as this machine can check them:
no GPU here, and neither mcc (MUSA) nor hipcc (DCU). What is checked:

* the C ABI header and the ctypes signatures / constants agree;
* every CUDA runtime name the sources use is mapped by both vendor glue headers;
* (the nvcc build itself, every architecture, warnings as errors, is CMake's: make setup;
  tests/test_cuda_backend.py reads back what it embedded);
* the float16 / bfloat16 / FP8 bit conversions, compiled for the host with g++, equal
  torch's on every 16-bit and 8-bit pattern and on rounding ties (slow);
* the nvcc-built library loads, and every launcher's arguments pass the kernels' host-side
  size checks (the launch itself then fails for want of a device -- or, on a machine with a
  CUDA GPU, runs and is compared with the reference);
* the kernels themselves run on a CPU simulator (tests/emulators/cuda_sim) and match the
  reference, alone, behind the musa and dcu adapters, and over the conformance suite's cases.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends import _cuda_dialect as gpu
from glm5_hal.backends._cuda_dialect import GpuKernelLibrary, KernelError
from glm5_hal.kernel_library import ABI_HEADER, INCLUDE_DIR

from conftest import REPO, seeded

# the CUDA-dialect ABI and the kernel ABI every library shares, which it includes
HEADER_TEXT = gpu.HEADER.read_text() + ABI_HEADER.read_text()
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
    for match in re.finditer(r"^(const char\*|int)\s+(glm5_hal_\w+)\(([^)]*)\);", HEADER_TEXT, re.M):
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
    assert {enum("GLM5_HAL_F32"), enum("GLM5_HAL_F16"), enum("GLM5_HAL_BF16"),
            enum("GLM5_HAL_FP8_E4M3")} == set(gpu.DTYPE_CODE.values())
    assert [gpu.DTYPE_CODE[d] for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)] == [
        enum("GLM5_HAL_F32"), enum("GLM5_HAL_F16"), enum("GLM5_HAL_BF16"), enum("GLM5_HAL_FP8_E4M3")]
    assert (enum("GLM5_HAL_OK"), enum("GLM5_HAL_EINVAL")) == (gpu.OK, gpu.EINVAL)
    kernel_heads = int(re.search(r"heads > (\d+)", (gpu.SOURCES / "indexer_topk.cu").read_text()).group(1))
    assert kernel_heads == gpu.INDEXER_MAX_HEADS


@pytest.mark.parametrize("target", sorted(GLUE))
def test_every_cuda_runtime_name_the_sources_use_is_mapped_by_the_glue(target):
    used = set()
    for path in [*SOURCES, *gpu.SOURCES.glob("*.h"), *gpu.SOURCES.glob("*.cuh")]:
        used |= set(re.findall(r"\bcuda[A-Z]\w*", path.read_text()))
    mapped = set(re.findall(r"#define (cuda\w+) ", GLUE[target].read_text()))
    assert used and used <= mapped, used - mapped


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
    from glm5_hal.backends.cuda.kernels import cuda_kernels
    library = cuda_kernels()
    if library.missing():
        pytest.skip(f"the nvcc build is not usable: {library.missing()}")
    return library


def test_the_cuda_build_loads_and_a_library_of_another_target_is_refused(cuda_build):
    assert cuda_build.status() == "built (libglm5_hal_cuda_kernels.so)"
    other = GpuKernelLibrary(cuda_build.path, label="MUSA kernel", target="musa", hint="")
    assert other.missing() == ("MUSA kernel library libglm5_hal_cuda_kernels.so was built for cuda (ABI 2), "
                               "expected musa (ABI 2); rebuild glm5_hal")


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
        "sparse_mla_decode": (lambda k, s: k.sparse_mla_decode_paged(*to(mla_q, mla_kv, table, lens, mla_idx), 0.1, 64,
                                                                     s),
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
        cuda_build.sparse_mla_decode_paged(q, kv, table, lens, idx, 0.1, 64, 0)
    with pytest.raises(KernelError, match="EINVAL"):
        cuda_build.sparse_mla_decode_paged(q[..., :64], kv[..., :64], table, lens, idx, float("inf"), 64, 0)


# -- the kernels themselves, run on the CPU simulator --------------------------------------------
# tests/emulators/cuda_sim builds the same sources with g++ on a thread-per-GPU-thread runtime
# (real barriers, shared memory and atomics), so the kernel code below runs for real, through
# the same launchers and C ABI the MUSA and DCU builds use. It checks the kernels' logic, not
# their speed, and nothing about mcc or hipcc.
@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> GpuKernelLibrary:
    from emulators import cuda_sim
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no host C++ compiler for the kernel simulator")
    path = cuda_sim.build(gpu.HERE, tmp_path_factory.mktemp("cuda_sim"))
    library = GpuKernelLibrary(path, label="simulated kernel", target="sim", hint="")
    assert library.missing() is None, library.missing()
    return library


def test_the_simulator_rewrites_launches_and_dynamic_shared_memory():
    from emulators.cuda_sim import simify
    source = ("extern __shared__ float shared[];\n"
              "k<A, B><<<grid, kThreads, bytes, s>>>(static_cast<const T*>(q), n);\n")
    assert simify(source) == ("float* shared = glm5_hal_sim::dynamic_shared<float>();\n"
                              "glm5_hal_sim::launch(grid, kThreads, bytes, s, [&] { k<A, B>(static_cast<const T*>(q), n); });\n")


def topk_sets_equal_or_tied(got, want, logits):
    """Same positions per row, except that entries tied at the k-th value may differ."""
    got, want, logits = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]), logits.reshape(
        -1, logits.shape[-1])
    for g_row, w_row, scores in zip(got, want, logits):
        assert (g_row >= 0).sum() == (w_row >= 0).sum() and bool((g_row[(g_row >= 0).sum():] == -1).all())
        g_set = {int(v) for v in g_row if v >= 0}
        w_set = {int(v) for v in w_row if v >= 0}
        assert len(g_set) == int((g_row >= 0).sum())
        if g_set != w_set:
            kth = min(float(scores[v]) for v in w_set)
            assert all(float(scores[v]) == kth for v in g_set ^ w_set), (g_set ^ w_set)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_simulated_sparse_mla_decode_matches_the_reference(simulated, dtype):
    g = seeded(20)
    batch, queries, heads, dqk, d_v, block_size = 2, 2, 3, 80, 48, 8
    q = torch.randn(batch, queries, heads, dqk, generator=g).to(dtype)
    cache = torch.randn(6, block_size, dqk, generator=g).to(dtype)
    table = torch.tensor([[5, 2, 0], [1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([21, 0], dtype=torch.int32)
    indices = torch.randint(-3, 30, (batch, queries, 150), generator=g, dtype=torch.int32)  # two chunks of 128
    indices[0, 1, :10] = 4  # duplicates count per occurrence
    out, lse = simulated.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.125, d_v, 0)
    ref_out, ref_lse = hal.reference.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.125, d_v)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert bool((lse[1] == float("-inf")).all()) and bool((out[1] == 0).all())


@pytest.mark.slow
def test_simulated_sparse_mla_decode_rescales_when_a_later_chunk_holds_the_maximum(simulated):
    """300 distinct keys in three chunks of 128: the running max moves between chunks."""
    g = seeded(26)
    q, cache = torch.randn(1, 3, 4, 32, generator=g), torch.randn(20, 16, 32, generator=g) * 3
    table, lens = torch.randperm(20, generator=g).to(torch.int32).view(1, 20), torch.tensor([300], dtype=torch.int32)
    indices = torch.stack([torch.randperm(300, generator=g) for _ in range(3)]).to(torch.int32).view(1, 3, 300)
    out, lse = simulated.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.5, 32, 0)
    ref_out, ref_lse = hal.reference.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.5, 32)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("heads, dqk, d_v", [(40, 101, 72), (17, 640, 600)], ids=["two-groups-of-32", "wide-d_v"])
def test_simulated_sparse_mla_decode_serves_every_head_group(simulated, heads, dqk, d_v):
    """A block serves one token and a group of heads (32, or 16 when d_v > 512): more heads
    than one group, a Dqk that is not a multiple of the 64-dim chunks, and a tile of 64 rows
    with no valid position between valid ones (skipped as a whole)."""
    g = seeded(27)
    q = torch.randn(1, 2, heads, dqk, generator=g).to(torch.bfloat16)
    cache = torch.randn(9, 16, dqk, generator=g).to(torch.bfloat16)
    table = torch.tensor([[4, 0, 7, 2, 8, 1]], dtype=torch.int32)
    lens = torch.tensor([90], dtype=torch.int32)
    indices = torch.randint(0, 90, (1, 2, 150), generator=g, dtype=torch.int32)
    indices[:, :, 64:128] = -1  # the second tile: nothing to read
    indices[0, 1, 140:] = 90    # past the context: invalid
    out, lse = simulated.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.09, d_v, 0)
    ref_out, ref_lse = hal.reference.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.09, d_v)
    torch.testing.assert_close(out, ref_out, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_simulated_indexer_topk_selects_the_reference_set(simulated):
    g = seeded(21)
    tokens, heads, dim, keys = 6, 3, 16, 700
    q, k, w = torch.randn(tokens, heads, dim, generator=g), torch.randn(keys, dim, generator=g), torch.rand(
        tokens, heads, generator=g)
    starts = torch.tensor([0, 0, 10, 300, 5, 0], dtype=torch.int32)
    ends = torch.tensor([700, 3, 10, 700, 650, 1], dtype=torch.int32)
    for topk in (1, 40):
        got = simulated.indexer_topk(q, k, None, w, starts, ends, topk, 0)
        want = hal.reference.indexer_topk(q, k, w, starts, ends, topk)
        topk_sets_equal_or_tied(got, want, hal.reference.indexer_logits(q, k, w, starts, ends))


@pytest.mark.slow
def test_simulated_indexer_topk_handles_ties_and_fp8_keys(simulated):
    g = seeded(22)
    q, w = torch.randn(2, 2, 16, generator=g), torch.rand(2, 2, generator=g)
    k8 = torch.ones(300, 16).to(torch.float8_e4m3fn)  # every key ties
    scale = torch.ones(300)
    starts, ends = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([300, 290], dtype=torch.int32)
    got = simulated.indexer_topk(q, k8, scale, w, starts, ends, 17, 0)
    for row, start, end in zip(got, starts.tolist(), ends.tolist()):
        assert len(set(row.tolist())) == 17 and all(start <= v < end for v in row.tolist())
    k8 = torch.randn(300, 16, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(300, generator=g) + 0.5
    got = simulated.indexer_topk(q, k8, scale, w, starts, ends, 17, 0)
    want = hal.reference.indexer_topk(q, (k8, scale), w, starts, ends, 17)
    topk_sets_equal_or_tied(got, want, hal.reference.indexer_logits(q, (k8, scale), w, starts, ends))


@pytest.mark.slow
def test_simulated_indexer_topk_paged_matches_the_reference(simulated):
    g = seeded(23)
    batch, queries, heads, dim, block_size = 3, 2, 2, 16, 16
    q, cache = torch.randn(batch, queries, heads, dim, generator=g), torch.randn(12, block_size, dim, generator=g)
    w = torch.rand(batch, queries, heads, generator=g)
    table = torch.tensor([[11, 3, 0, 7, 2, 9, 1, 5], [4, -1, -1, -1, -1, -1, -1, -1],
                          [6, 8, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([120, 1, 17], dtype=torch.int32)
    got = simulated.indexer_topk_paged(q, cache, None, w, table, lens, 10, 0)
    want = hal.reference.indexer_topk_paged(q, cache, w, table, lens, 10)
    keys = [torch.stack([cache[int(table[b, p // block_size]), p % block_size] for p in range(int(lens[b]))])
            for b in range(batch)]
    for b in range(batch):
        ends = (lens[b] - queries + 1 + torch.arange(queries)).clamp(min=0).to(torch.int32)
        logits = hal.reference.indexer_logits(q[b], keys[b], w[b], torch.zeros(queries, dtype=torch.int32), ends)
        topk_sets_equal_or_tied(got[b], want[b], logits)


@pytest.mark.slow
def test_simulated_small_kernels_match_the_reference(simulated):
    g = seeded(24)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(4, 3, 18, generator=g).to(dtype)
        torch.testing.assert_close(simulated.silu_and_mul(x, 0), hal.reference.silu_and_mul(x), rtol=1e-2, atol=1e-5)
    for slot_dtype, cache_dtype in ((torch.int32, torch.bfloat16), (torch.int64, torch.float8_e4m3fn)):
        cache = torch.randn(3, 4, 8, generator=g).to(cache_dtype)
        values = torch.randn(5, 8, generator=g).to(cache_dtype)
        slots = torch.tensor([11, -1, 0, 5, -1], dtype=slot_dtype)
        want = cache.clone()
        hal.reference.kv_cache_write(want, values, slots)
        simulated.kv_cache_write(cache, values, slots, 0)
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    x, ids = torch.randn(9, 24, generator=g).to(torch.bfloat16), torch.randint(-1, 6, (9, 4), generator=g,
                                                                                  dtype=torch.int32)
    ids[3] = 2  # one expert chosen twice by a token
    got, want = simulated.moe_permute(x, ids, 5, 0), hal.reference.moe_permute(x, ids, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    weights = torch.rand(9, 4, generator=g)
    src = torch.cat((want[2], want[2][:3]))  # repeated rows add
    y = torch.randn(src.shape[0], 24, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(simulated.moe_unpermute(y, src, weights, 0), hal.reference.moe_unpermute(y, src, weights),
                               rtol=1.6e-2, atol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["musa", "dcu"])
def test_backend_adapters_on_the_simulated_kernels_match_the_reference(simulated, vendor, hal_state, monkeypatch):
    """The kernel-backed ops of an emulated backend, end to end: dispatch, adapter, launcher,
    C ABI, kernel."""
    import types
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    if vendor == "musa":
        from glm5_hal.backends.musa import MusaBackend
        from emulators.musa import MusaEmulator
        backend = MusaBackend(runtime=MusaEmulator("S4000"), name="gpu_sim", device_type="cpu", priority=1000)
    else:
        from glm5_hal.backends.dcu import DcuBackend
        from emulators.dcu import DcuEmulator
        backend = DcuBackend(runtime=DcuEmulator("K100_AI", lightop=None), name="gpu_sim", device_type="cpu",
                             priority=1000)
    backend.kernels = simulated
    plugin = types.ModuleType("gpu_sim_plugin")
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(plugin, "gpu_sim")
    g = seeded(25)
    q, kv = torch.randn(3, 2, 72, generator=g), torch.randn(20, 72, generator=g)
    indices = torch.randint(-1, 24, (3, 9), generator=g, dtype=torch.int32)
    cache, table, lens = torch.randn(4, 8, 72, generator=g), torch.tensor([[3, 0], [1, 2]], dtype=torch.int32), \
        torch.tensor([13, 9], dtype=torch.int32)
    x = torch.randn(5, 12, generator=g)
    ids = torch.randint(0, 4, (5, 2), generator=g, dtype=torch.int32)
    calls = {
        "sparse_mla_attention": (q, kv, indices, 0.2, 64),
        "sparse_mla_decode_paged": (q.view(1, 3, 2, 72).expand(2, 3, 2, 72).contiguous(), cache, table, lens,
                                    indices.view(1, 3, 9).expand(2, 3, 9).contiguous(), 0.2, 64),
        "indexer_topk": (q, kv, torch.rand(3, 2, generator=g), torch.tensor([0, 2, 5], dtype=torch.int32),
                         torch.tensor([20, 3, 20], dtype=torch.int32), 4),
        "silu_and_mul": (x,),
        "moe_permute": (x, ids, 4),
    }
    for op, args in calls.items():
        assert hal.explain(op, *args).chosen == f"gpu_sim.{op}", (op, hal.explain(op, *args))
        got, want = getattr(hal.ops, op)(*args), getattr(hal.reference, op)(*args)
        if op == "indexer_topk":
            topk_sets_equal_or_tied(got, want, hal.reference.indexer_logits(*args[:5]))
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    written, expected = torch.zeros(4, 8, 72), torch.zeros(4, 8, 72)
    slots = torch.tensor([30, -1, 2], dtype=torch.int64)
    hal.ops.kv_cache_write(written, kv[:3], slots)
    hal.reference.kv_cache_write(expected, kv[:3], slots)
    assert torch.equal(written, expected)


KERNEL_BACKED_OPS = ("sparse_mla_attention", "sparse_mla_decode_paged", "indexer_topk", "indexer_topk_paged",
                     "silu_and_mul", "kv_cache_write", "moe_permute", "moe_unpermute")


def _ops_with_cases(ops):
    from glm5_hal.conformance import cases
    return [op for op in ops if op in cases.ops_with_cases()]


@pytest.mark.slow
@pytest.mark.parametrize("op", _ops_with_cases(KERNEL_BACKED_OPS))
def test_conformance_tiny_preset_on_the_simulated_kernels(simulated, op, hal_state, monkeypatch):
    """The conformance suite's cases for an op the musa backend serves with its own kernels,
    run through the emulated backend on the simulated kernel library: every case passes
    through the backend's own implementation (or is an input the op must refuse). An S4000
    keeps the sparse MLA ops on the kernel (an S5000 would use FlashMLA for bf16); the cache
    writes run on an S5000, whose capabilities include the FP8 caches."""
    import types
    from glm5_hal.backends.musa import MusaBackend
    from glm5_hal.conformance import plan, run_all
    from emulators.musa import MusaEmulator
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    card = "S5000" if op == "kv_cache_write" else "S4000"
    backend = MusaBackend(runtime=MusaEmulator(card), name="gpu_sim", device_type="cpu", priority=1000)
    backend.kernels = simulated
    plugin = types.ModuleType("gpu_sim_plugin")
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    hal_state(plugin, "gpu_sim")
    records = run_all(plan(["gpu_sim"], [op], ["tiny"]))
    assert records
    # the kernel writes contiguous caches; a block-strided page view is declined with that reason
    # and served by the reference (the kernel's flat slot indexing cannot address it)
    paged_view = [r for r in records if "paged_view" in r.case]
    assert all(r.status == "fallback" and "contiguous cache" in r.reason for r in paged_view), paged_view
    assert not [(r.case, r.status, r.reason) for r in records if r.status != "pass" and r not in paged_view]
    assert any(r.impl == f"gpu_sim.{op}" for r in records)
