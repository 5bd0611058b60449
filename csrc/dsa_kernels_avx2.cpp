// AVX2 + FMA tier of the DSA tile kernels: the portable register-blocked QK and PV
// (dsa_kernels_portable.h) compiled for 16 ymm registers with fused multiply-adds; the small
// kernels are the portable scalar ones. For x86-64 CPUs without AVX-512.
#include "dsa_kernels.h"

#if GLM5_DSA_X86

#include <immintrin.h>

namespace glm5::dsa {

// Everything defined between push and pop is compiled for AVX2 + FMA; the included kernels
// have internal linkage and use no standard-library templates (see dsa_kernels_portable.h).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define GLM5_VEC_FLOATS 8
#define GLM5_PORTABLE_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define GLM5_QK_VECS 4
#define GLM5_QK_KEYS 3
#define GLM5_PV_VECS 3
#include "dsa_kernels_portable.h"
#pragma GCC pop_options

const Kernels* avx2_kernels() {
  static const Kernels k{1,       portable_qk_f32,        nullptr,          portable_softmax_tile, portable_pv_f32,
                         nullptr, scalar::indexer_reduce, scalar::to_f32, scalar::fp8_to_bf16};
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok ? &k : nullptr;
}

}  // namespace glm5::dsa

#endif  // GLM5_DSA_X86
