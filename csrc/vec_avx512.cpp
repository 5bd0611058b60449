// The AVX-512 (F, BW, VL, DQ) tier of vec.h: vec_impl.h compiled for it. Handed out only after
// __builtin_cpu_supports says the CPU has the instructions.
#include <cmath>
#include <cstring>
#include <limits>

#include "vec.h"

#if GLM5_VEC_X86

#include <immintrin.h>

// GCC 12 reports the deliberately undefined lanes inside its own AVX-512 intrinsic headers
// (_mm512_undefined_*) as maybe-uninitialized at every inlined use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define GLM5_VEC_TIER 2
#include "vec_impl.h"
#pragma GCC pop_options

namespace glm5::vec {

const Kernels* avx512_kernels() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const Kernels k{kAvx512, load_row, store_row, accumulate_row, weighted_sum, sum_squares, abs_max,
                         scale_mul, sigmoid, silu_mul, fwht, rope, fp8_encode, int8_encode};
  return supported ? &k : nullptr;
}

}  // namespace glm5::vec

#endif  // GLM5_VEC_X86
