"""NVIDIA GPU generations, the versions the cuda backend's behaviours were read from, and the
constraints of the libraries it adapts (FlashMLA, DeepGEMM, torch's own CUDA ops).

Sources (README.md, "Sources"; no code was taken from them):
- deepseek-ai/FlashMLA, commits c28eca9 (2025-09-24, sparse kernels), fd249aa (2025-09-29,
  sm_100), 1408756 (2025-10-01, the last commit with the first interface), 082094b (2026-01-16,
  new interface), 9241ae3 (2026-04-29, newest read);
- deepseek-ai/DeepGEMM, tags v2.1.0 (594953a), v2.1.1 (93b3c28), 2.3.0 (0f5f266), 2.6.1 (54e2261);
- PyTorch 2.11.0 - 2.15.0: the torch-2.11.0+cu130, 2.12.0+cu130, 2.13.0+cu130, 2.14.1+cu130 and
  2.15.0+cu132 wheels (torchgen/packaged/ATen/native/native_functions.yaml, the strings and the
  disassembly of torch/lib/libtorch_cuda.so), with the logic of aten/src/ATen/native/cuda/
  GroupedBlas.cpp @00d4eaf9 and ScaledBlas.cpp @0174dfab where the wheels compile the same code,
  and test/test_scaled_matmul_cuda.py @00166b21 (cuBLASLt's padded 128x128 scale layout);
- nvcc 13.0 (V13.0.88): `nvcc --list-gpu-code`;
- NVIDIA's H200 product page (https://www.nvidia.com/en-us/data-center/h200/) and the Hopper
  tuning guide, for the roofline constants.
Every fact is one constant here, so a wrong one is one edit.
"""
from __future__ import annotations

import dataclasses
import math

from glm5_hal.vendor_backend import Behaviour, Era
from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: glm5_hal needs torch >= 2.6 (pyproject.toml); the torch-op behaviours below were read from 2.11 to 2.15.
MIN_TORCH = (2, 6)
#: The compute capabilities the CUDA-dialect kernels are compiled for (SASS), and the PTX
#: embedded for newer GPUs to JIT from (CMake's GLM5_HAL_CUDA_ARCHS default; a test compares).
KERNEL_SASS = (80, 90, 100)
KERNEL_PTX = 100
#: nvcc 13 dropped everything below sm_75; bf16 needs sm_80, the kernels' floor.
MIN_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class Generation:
    major: int
    name: str
    products: str
    tma: bool        # Tensor Memory Accelerator (cp.async.bulk.tensor), from sm_90
    wgmma: bool      # warpgroup MMA: sm_90a only
    tcgen05: bool    # 5th-generation tensor core instructions: sm_100a / sm_103a

    def fp8(self, minor: int) -> bool:
        """FP8 (e4m3) tensor cores: Ada (8.9) and every generation after Ampere."""
        return self.major >= 9 or (self.major, minor) >= (8, 9)

    def kernel_code(self, minor: int) -> str:
        """Which of the kernels' embedded codes a device of this capability runs: SASS of its
        major version with a minor not above its own, else the PTX, JIT-compiled by the driver."""
        sass = [a for a in KERNEL_SASS if a // 10 == self.major and a % 10 <= minor]
        return f"sm_{sass[-1]} SASS" if sass else f"compute_{KERNEL_PTX} PTX (JIT by the driver)"


GENERATIONS = (
    Generation(8, "Ampere / Ada", "A100, A800, A30 (8.0); A10, A40, RTX 30 (8.6); L4, L40, RTX 40 (8.9)",
               tma=False, wgmma=False, tcgen05=False),
    Generation(9, "Hopper", "H100, H200, H800, H20 (9.0)", tma=True, wgmma=True, tcgen05=False),
    Generation(10, "Blackwell", "B200, GB200 (10.0); B300 (10.3)", tma=True, wgmma=False, tcgen05=True),
    Generation(11, "Blackwell (Thor)", "Jetson Thor (11.0)", tma=True, wgmma=False, tcgen05=False),
    Generation(12, "Blackwell (client)", "RTX 50, RTX PRO 6000 (12.0); DGX Spark (12.1)", tma=True, wgmma=False,
               tcgen05=False),
)


def generation_of(capability: tuple[int, int]) -> Generation | None:
    for gen in GENERATIONS:
        if gen.major == capability[0]:
            return gen
    return None


def device_dtypes(gen: Generation, minor: int) -> frozenset:
    return shared_device_dtypes(bf16=True, fp8=gen.fp8(minor))


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's dense peak throughput and memory bandwidth, for roofline percentages."""
    bf16_tflops: float
    fp8_tflops: float
    hbm_tbps: float
    source: str


#: Dense (no 2:4 sparsity) peaks, by a substring of torch.cuda.get_device_name().
PEAKS = {
    "H200": Peak(989.4, 1978.9, 4.8,
                 "NVIDIA H200 product page (SXM: 1,979 / 3,958 TFLOPS with sparsity, 4.8 TB/s HBM3e); "
                 "dense = half: 132 SMs x 4 tensor cores x 512 bf16 FMA/clk x 2 x 1.83 GHz = 989.4 TFLOP/s"),
}


def peak_of(device_name: str) -> Peak | None:
    for key, peak in PEAKS.items():
        if key in device_name:
            return peak
    return None


# -- FlashMLA --------------------------------------------------------------------------------------
#: FlashMLA's package version is "1.0.0" at every commit (flash_mla/__init__.py; setup.py appends
#: "+<git rev>"), so its versions are told apart by the interface of flash_mla_sparse_fwd, read
#: from flash_mla/flash_mla_interface.py without importing the extension (runtime.py):
#:   1: (q, kv, indices, sm_scale, d_v=512)                  c28eca9 .. 1408756  (2025-09-24 .. 2025-10-01)
#:   2: (..., d_v=512, attn_sink=None, topk_length=None)     082094b .. 9241ae3  (2026-01-16 ..)
#: (deepseek-ai/FlashMLA history: 082094b added attn_sink / topk_length, two commits before
#: 48c6dc4 (082094b -> c741387 -> 48c6dc4); its parent 1408756 still has the five parameters.)
#:   3: parameters beyond those: a newer interface, not verified
#: The first and the newest commit read of each generation (the README states them).
FLASH_MLA_INTERFACE_COMMITS = {1: ("c28eca9", "1408756"), 2: ("082094b", "9241ae3")}
FLASH_MLA_INTERFACES = (
    ("q", "kv", "indices", "sm_scale", "d_v"),
    ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length"),
)
FLASH_MLA_PACKAGE = "flash_mla_interface"   # the versions() key the behaviours below read

#: flash_mla_sparse_fwd's log-sum-exp (and max_logits): the natural-log base the adapter
#: multiplies by; rows without a valid index are masked by the adapter in either era.
FLASH_MLA_SPARSE_LSE = Behaviour(
    "flash_mla_sparse_lse_base", FLASH_MLA_PACKAGE, (
        Era((1,), 2.0, "deepseek-ai/FlashMLA flash_mla/flash_mla_interface.py docstring (\"2-based "
                       "log-sum-exp\") and csrc/sm90/prefill/sparse/fwd.cu l.528-529 (final_lse = log2f(L) + M) "
                       "@fd249aa, same @c28eca9"),
        Era((2,), math.e, "deepseek-ai/FlashMLA csrc/sm90/prefill/sparse/phase1.cuh l.448-449 @082094b "
                          "(final_lse = logf(L) + M * ln 2; empty rows +inf); tests/ref.py l.19-52 @9241ae3")),
    verified_up_to=(2,))
#: The query-head counts flash_mla_sparse_fwd takes, per device major: the adapter pads the
#: heads to the smallest count that holds them, or runs them in chunks of the largest.
FLASH_MLA_SPARSE_HEADS = Behaviour(
    "flash_mla_sparse_heads", FLASH_MLA_PACKAGE, (
        # sm_100 sparse kernels arrived in fd249aa, whose interface equals c28eca9's (Hopper only)
        Era((1,), {9: (64, 128)}, "deepseek-ai/FlashMLA csrc/sm90/prefill/sparse/fwd.cu l.644-647 (h_q % 64) "
                                  "@fd249aa; sm_100 (h_q == 128) not told apart from c28eca9 by the interface"),
        Era((2,), {9: (64, 128), 10: (64, 128)}, "deepseek-ai/FlashMLA csrc/api/sparse_fwd.h l.112-115, "
                                                 "l.191-198 (h_q in {64, 128}; sm90a or sm100f) @9241ae3")),
    verified_up_to=(2,))
#: (d_qk, d_v) pairs flash_mla_sparse_fwd takes.
FLASH_MLA_SPARSE_DIMS = Behaviour(
    "flash_mla_sparse_dims", FLASH_MLA_PACKAGE, (
        Era((1,), ((576, 512),), "deepseek-ai/FlashMLA csrc/pybind.cpp sparse_prefill_fwd l.386-449 @fd249aa"),
        Era((2,), ((576, 512), (512, 512)), "deepseek-ai/FlashMLA csrc/api/sparse_fwd.h l.131-132 @9241ae3")),
    verified_up_to=(2,))
#: Top-k is padded with -1 to a multiple of this (sm90 asserts topk % 128; sm100 % 64 or % 128).
FLASH_MLA_TOPK_MULTIPLE = 128
#: flash_mla_with_kvcache(..., indices=) -- FlashMLA's sparse *decode* kernel -- asserts
#: is_fp8_kvcache (flash_mla/flash_mla_interface.py l.151-154 @9241ae3): it reads only the
#: 656-byte FP8 MLA cache (512 e4m3 + 4 float32 scales + 64 bf16 rope per token). The
#: contract's cache holds rows of q's dtype, so decode goes through flash_mla_sparse_fwd over
#: the flattened cache, as vLLM's FLASHMLA_SPARSE backend does for a bf16 cache
#: (vllm/v1/attention/backends/mla/flashmla_sparse.py @60191e18).
FLASH_MLA_DECODE_KERNEL_DECLINED = (
    "flash_mla_with_kvcache's sparse decode kernel reads only the 656-byte FP8 MLA cache (it asserts "
    "is_fp8_kvcache); this cache holds {dtype} rows, so flash_mla_sparse_fwd serves it over the flattened cache")

# -- DeepGEMM --------------------------------------------------------------------------------------
#: The grouped GEMM's 4th argument (passed positionally): a per-row int32 expert id, -1 on the
#: padding rows that align each expert's segment (get_mk_alignment_for_contiguous_layout()).
DEEP_GEMM_CONTIGUOUS_LAYOUT = Behaviour(
    "deep_gemm_contiguous_layout", "deep_gemm", (
        Era((2, 1, 0), "m_indices", "deepseek-ai/DeepGEMM csrc/apis/gemm.hpp l.525-528 @v2.1.1; "
                                    "tests/generators.py generate_m_grouped_contiguous l.183-217 @v2.1.1"),
        Era((2, 3, 0), "grouped_layout (use_psum_layout=False: per-row ids as before)",
            "deepseek-ai/DeepGEMM csrc/apis/gemm.hpp l.624-631 @0f5f266, l.673-681 @54e2261")),
    verified_up_to=(2, 6, 1))
#: sm_100 converts fp32 scales to UE8M0 (the exponent only): the DeepSeek-V3 / GLM-5
#: weight_scale_inv values are arbitrary fp32, and checking them would read device memory.
DEEP_GEMM_SM100_DECLINED = (
    "DeepGEMM on sm_100 turns float32 scales into UE8M0 powers of two (up to 2.5.0 silently, from 2.6.1 "
    "with a device assert: csrc/jit_kernels/impls/smxx_layout.hpp @v2.1.1, deep_gemm/include/deep_gemm/impls/"
    "smxx_layout.cuh @54e2261); checkpoint block scales are arbitrary float32")

# -- torch's own CUDA ops (read from 2.11 to 2.15) ----------------------------------------------------
#: The torch wheels read, one per minor version (PyPI's manylinux x86_64 builds): 2.11.0+cu130
#: (git 70d99e99), 2.12.0+cu130 (7661cd9c), 2.13.0+cu130 (cf30153c), 2.14.1+cu130 (5c488690),
#: 2.15.0+cu132 (d0f2af8b). For each: the op's schema and CUDA kernel in
#: torchgen/packaged/ATen/native/native_functions.yaml, the messages in torch/lib/libtorch_cuda.so,
#: and where a condition is compiled code, the disassembly of the function that holds it.
TORCH_WHEELS_READ = "2.11.0+cu130, 2.12.0+cu130, 2.13.0+cu130, 2.14.1+cu130, 2.15.0+cu132"
TORCH_GROUPED_MM = Behaviour(
    "torch_grouped_mm_fast_path", "torch", (
        Era((2, 11), (9, 10), "aten/src/ATen/native/cuda/GroupedBlas.cpp @00d4eaf9 (_grouped_mm_cuda: bf16 x bf16 -> "
                              "bf16 on capability major 9 or 10 -> bf16bf16_grouped_mm, else _grouped_mm_fallback: "
                              "offs.cpu() and one mm per group); native_functions.yaml `_grouped_mm` -> CUDA: "
                              "_grouped_mm_cuda unchanged in the wheels " + TORCH_WHEELS_READ + " (2.15 adds MPS "
                              "only); _grouped_mm_cuda's code in libtorch_cuda.so: 2.11-2.13 read "
                              "deviceProperties.major - 9 < 2, 2.14-2.15 compare the dtypes with BFloat16 (15) and "
                              "call scaled_mm_arch_allowed(true, true) (major 9 or 10); every version calls "
                              "bf16bf16_grouped_mm or _grouped_mm_fallback (\"fallback path for `torch._grouped_mm`, "
                              "performance may not be optimal\")"),),
    verified_up_to=(2, 15))
#: cuBLASLt reads 128x128 block scales as [L4, ceil(N / 128)] K-major, L4 = ceil(K / 128)
#: rounded up to a multiple of 4 (pytorch test/test_scaled_matmul_cuda.py @00166b21,
#: _pad_128x128_scales, after docs.nvidia.com/cuda/cublas "1D and 128x128 2D block scaling for
#: FP8"; test_scaled_mm_block_wise_numerics pads them, M,N,K = (384, 128, 1280) "Requires padding
#: for 128x128 scale"). torch._scaled_mm (the v1 entry point the adapter calls) accepts the
#: weight scales only unpadded: is_blockwise_128x128_scaling checks scale_b.t() for size
#: (ceil(N/128), ceil(K/128)) with stride (ceil(K/128), 1), stride ignored where the size is 1
#: (ScaledBlas.cpp @0174dfab; the same check, with no round-up, compiled into
#: is_desired_scaling in every wheel read), and hands cuBLASLt only the pointer. So where
#: ceil(K/128) % 4 != 0 and ceil(N/128) > 1 the only layout v1 takes is not the one cuBLASLt
#: reads: every weight-block row after the first would be read at the wrong offset, silently.
#: The adapter zero-pads K there until ceil(K/128) is a multiple of this (ops._pad_k).
SCALED_MM_SCALE_K_BLOCKS_MULTIPLE = 4
TORCH_SCALED_MM_BLOCKWISE = Behaviour(
    "torch_scaled_mm_blockwise", "torch", (
        Era((2, 11), (9,), "libtorch_cuda.so of the wheels " + TORCH_WHEELS_READ + ": \"DeepSeek style (1x128, "
                           "128x128) scaling only supported in CUDA for SM90\" (_check_deepseek_support) and the "
                           "unpadded 1x128 / 128x128 scale checks of is_desired_scaling; native_functions.yaml "
                           "`_scaled_mm` -> CUDA: _scaled_mm_cuda unchanged; aten/src/ATen/native/cuda/"
                           "ScaledBlas.cpp @0174dfab"),),
    verified_up_to=(2, 15))
TORCH_FUSED_RMS_NORM = Behaviour(
    "torch_fused_rms_norm", "torch", (
        Era((2, 11), "_fused_rms_norm_cuda", "torchgen/packaged/ATen/native/native_functions.yaml: `rms_norm` "
                                             "(CompositeImplicitAutograd: rms_norm_symint) and `_fused_rms_norm` "
                                             "(CUDA: _fused_rms_norm_cuda), l.3345/3349 in 2.11.0, 3382/3386 in "
                                             "2.12.0, 3250/3254 in 2.13.0, 3300/3304 in 2.14.1 and 2.15.0; schemas "
                                             "and CUDA kernel unchanged (2.12 adds an XPU kernel only)"),),
    verified_up_to=(2, 15))

BEHAVIOURS = (FLASH_MLA_SPARSE_LSE, FLASH_MLA_SPARSE_HEADS, FLASH_MLA_SPARSE_DIMS, DEEP_GEMM_CONTIGUOUS_LAYOUT,
              TORCH_GROUPED_MM, TORCH_SCALED_MM_BLOCKWISE, TORCH_FUSED_RMS_NORM)
