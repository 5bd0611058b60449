// AVX-512 tier of the quantized GEMM tiles: bfloat16 pairs with vdpbf16ps (AVX-512 BF16) and
// int8 quads with vpdpbusd (AVX-512 VNNI). Register blocking: 12 rows x 32 columns (24 zmm
// accumulators, the two panel vectors of a K step, one broadcast of the row's K pair / quad).
// Every function carries a target attribute and has internal linkage (the file is compiled for
// baseline x86-64); the tables are handed out only when the CPU has the instructions.
//
// vdpbf16ps ignores MXCSR: bfloat16 subnormal inputs (|x| < 2^-126) count as 0 and subnormal
// results flush to 0. FP8 values are never bfloat16 subnormals (the smallest e4m3 is 2^-9);
// for bfloat16 inputs the flushed contributions are below 2^-126 each.
#include "qgemm_kernels.h"

#if GLM5_QGEMM_X86

#include <immintrin.h>

#include <cstring>

// GCC 12 reports the deliberately undefined lanes inside its own AVX-512 intrinsic headers
// (_mm512_undefined_*) as maybe-uninitialized at every inlined use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define GLM5_T512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")))
#define GLM5_T512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2")))

namespace glm5::qgemm {

namespace {

constexpr int kMr = 12;

inline int32_t load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Adds (or, first, stores) one block's sums into C: c = c + acc * scale (scale given) or c + acc.
template <int MR>
GLM5_T512BF16 inline void flush_float(__m512 (&acc)[MR][2], float* c, int64_t ldc, bool first, const float* rs,
                                      int64_t rs_stride, const float* cs, int64_t blk) {
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cr + 16 * v);
      const __m512 sum = cs ? _mm512_fmadd_ps(acc[r][v], _mm512_set1_ps(rs[r * rs_stride + blk] * cs[blk]), prev)
                            : _mm512_add_ps(prev, acc[r][v]);
      _mm512_storeu_ps(cr + 16 * v, sum);
    }
  }
}

GLM5_T512BF16 void float_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* c, int64_t ldc,
                              bool accumulate, const float* rs, int64_t rs_stride, const float* cs) {
  const int64_t step = cs ? kScaleBlock : kc;
  for (int64_t k0 = 0, blk = 0; k0 < kc; k0 += step, ++blk) {
    __m512 acc[kMr][2];
#pragma GCC unroll 12
    for (int r = 0; r < kMr; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = k0 / 2; p < (k0 + step) / 2; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * 2 * kNr);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * 2 * kNr + kNr);
#pragma GCC unroll 12
      for (int r = 0; r < kMr; ++r) {
        const __m512bh ap = (__m512bh)_mm512_set1_epi32(load32(a + r * lda + 2 * p));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ap, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ap, b1);
      }
    }
    flush_float<kMr>(acc, c, ldc, k0 == 0 && !accumulate, rs, rs_stride, cs, blk);
  }
}

GLM5_T512VNNI void int8_tile(const int8_t* a, int64_t lda, const int8_t* b, int64_t kc, int32_t* c, int64_t ldc,
                             bool accumulate) {
  __m512i acc[kMr][2];
#pragma GCC unroll 12
  for (int r = 0; r < kMr; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int64_t q = 0; q < kc / 4; ++q) {
    const __m512i b0 = _mm512_loadu_si512(b + q * 4 * kNr);
    const __m512i b1 = _mm512_loadu_si512(b + q * 4 * kNr + 2 * kNr);
#pragma GCC unroll 12
    for (int r = 0; r < kMr; ++r) {
      const __m512i aq = _mm512_set1_epi32(load32(a + r * lda + 4 * q));  // unsigned bytes (x + 128)
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], aq, b0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], aq, b1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < kMr; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      int32_t* cr = c + r * ldc + 16 * v;
      const __m512i sum = accumulate ? _mm512_add_epi32(_mm512_loadu_si512(cr), acc[r][v]) : acc[r][v];
      _mm512_storeu_si512(cr, sum);
    }
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma");
}

}  // namespace

const FloatTile* avx512_float_tile() {
  static const FloatTile t{kAvx512, kMr, nullptr, nullptr, float_tile};
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok ? &t : nullptr;
}

const Int8Tile* avx512_int8_tile() {
  static const Int8Tile t{kAvx512, kMr, nullptr, nullptr, true, int8_tile};
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok ? &t : nullptr;
}

}  // namespace glm5::qgemm

#endif  // GLM5_QGEMM_X86
