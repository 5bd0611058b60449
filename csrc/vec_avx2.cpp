// The AVX2 + FMA + F16C tier of vec.h: vec_impl.h compiled for it. Handed out only after
// __builtin_cpu_supports says the CPU has the instructions.
#include <cmath>
#include <cstring>
#include <limits>

#include "vec.h"

#if GLM5_VEC_X86

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define GLM5_VEC_TIER 1
#include "vec_impl.h"
#pragma GCC pop_options

namespace glm5::vec {

const Kernels* avx2_kernels() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const Kernels k{kAvx2, load_row, store_row, accumulate_row, weighted_sum, sum_squares, abs_max,
                         scale_mul, sigmoid, silu_mul, fwht, rope, fp8_encode, int8_encode};
  return supported ? &k : nullptr;
}

}  // namespace glm5::vec

#endif  // GLM5_VEC_X86
