// Row primitives shared by the elementwise, MoE, KV and quantization kernels, in one table per
// instruction-set tier, picked at run time: portable C++ (vec_portable.cpp), the same source
// compiled for AVX2 + FMA + F16C (vec_avx2.cpp) and for AVX-512 (vec_avx512.cpp). The drivers
// (common_ops.cpp, moe.cpp, kv.cpp, quant.cpp) validate every input and parallelise over rows;
// these functions only ever see in-bounds pointers and work on one row at a time, mostly on a
// float32 scratch row that stays in L1.
#pragma once

#include <cstdint>

#include "core.h"

// Vector tiers exist on x86-64 with GCC/Clang target attributes. GLM5_HAL_PORTABLE_ONLY builds
// what every other architecture gets.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(GLM5_HAL_PORTABLE_ONLY)
#define GLM5_VEC_X86 1
#else
#define GLM5_VEC_X86 0
#endif

namespace glm5::vec {

enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

struct Kernels {
  int isa;
  // dst[i] = float(src[i]) for a float dtype (F32, F16, BF16).
  void (*load)(DType dtype, const void* src, int64_t n, float* dst);
  // dst[i] = src[i] rounded to nearest even in `dtype` (F32, F16, BF16).
  void (*store)(DType dtype, const float* src, int64_t n, void* dst);
  // acc[i] += a * float(y[i]) for a float dtype.
  void (*accumulate)(DType dtype, const void* y, float a, int64_t n, float* acc);
  // out[i] = dtype(sum over r < nrows, in order, of w[r] * float(rows[r][i])), i < n; all rows
  // and out of one float dtype; nrows = 0 writes zeros. The sums stay in registers.
  void (*weighted_sum)(DType dtype, const void* const* rows, const float* w, int64_t nrows, int64_t n, void* out);
  float (*sum_squares)(const float* x, int64_t n);
  float (*abs_max)(const float* x, int64_t n);
  // x[i] = x[i] * s * w[i]
  void (*scale_mul)(float* x, const float* w, float s, int64_t n);
  // x[i] = 1 / (1 + exp(-x[i]))
  void (*sigmoid)(float* x, int64_t n);
  // gate[i] = silu(gate[i]) * up[i]
  void (*silu_mul)(float* gate, const float* up, int64_t n);
  // In-place fast Walsh-Hadamard transform (Sylvester order) of n = 2^m values, times scale.
  void (*fwht)(float* x, int64_t n, float scale);
  // Rotates the pairs (x[2i], x[2i+1]) (interleaved) or (x[i], x[i + half]) by the angle
  // with cos[i], sin[i], for i < half: (a, b) -> (a cos - b sin, a sin + b cos).
  void (*rope)(float* x, const float* cos, const float* sin, int64_t half, bool interleaved);
  // q[i] = float8_e4m3fn(clamp(x[i] / scale, -448, 448)), round to nearest even; nan stays nan.
  void (*fp8_encode)(const float* x, float scale, int64_t n, uint8_t* q);
  // q[i] = clamp(round_half_even(x[i] / scale), -127, 127); nan gives 0.
  void (*int8_encode)(const float* x, float scale, int64_t n, int8_t* q);
};

const Kernels& portable_kernels();
#if GLM5_VEC_X86
// Null when the CPU lacks the tier.
const Kernels* avx2_kernels();
const Kernels* avx512_kernels();
#endif

// The best tier the CPU supports, capped by set_isa_limit (tests run every tier this way).
const Kernels& kernels();
int isa();
int max_isa();
int set_isa_limit(int limit);  // returns the previous limit

}  // namespace glm5::vec
