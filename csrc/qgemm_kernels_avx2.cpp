// AVX2 tier of the quantized GEMM tiles, for x86-64 CPUs without AVX-512:
// - bfloat16 pairs: each packed pair vector splits into its even-K and odd-K float32 halves
//   (a shift and a mask, exact), then fused multiply-adds; 2 rows x 32 columns.
// - int8 without VNNI: bytes sign-extended to 16-bit even/odd halves and multiplied with
//   vpmaddwd (exact int32 pairs); 2 rows x 32 columns.
// - int8 with AVX-VNNI: vpdpbusd on unsigned (x + 128) by signed bytes; 3 rows x 32 columns.
// Every function carries a target attribute and has internal linkage.
#include "qgemm_kernels.h"

#if GLM5_QGEMM_X86

#include <immintrin.h>

#include <cstring>

#define GLM5_TAVX2 __attribute__((target("avx2,fma")))
#define GLM5_TAVXVNNI __attribute__((target("avx2,fma,avxvnni")))

namespace glm5::qgemm {

namespace {

constexpr int kVecs = kNr / 8;   // ymm vectors per 32 columns

inline int32_t load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ---- bfloat16 pairs ------------------------------------------------------------------------

constexpr int kFloatMr = 2;

GLM5_TAVX2 void float_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* c, int64_t ldc,
                           bool accumulate, const BlockScales* scales) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t step = scales ? kScaleBlock : kc;
  for (int64_t k0 = 0, blk = 0; k0 < kc; k0 += step, ++blk) {
    __m256 acc[kFloatMr][kVecs];
    for (int r = 0; r < kFloatMr; ++r)
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t p = k0 / 2; p < (k0 + step) / 2; ++p) {
      __m256 a_even[kFloatMr], a_odd[kFloatMr];
      for (int r = 0; r < kFloatMr; ++r) {
        const __m256i pair = _mm256_set1_epi32(load32(a + r * lda + 2 * p));
        a_even[r] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
        a_odd[r] = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
      }
      const uint16_t* bp = b + p * 2 * kNr;
      for (int v = 0; v < kVecs; ++v) {
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 16 * v));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
        for (int r = 0; r < kFloatMr; ++r)
          acc[r][v] = _mm256_fmadd_ps(a_odd[r], odd, _mm256_fmadd_ps(a_even[r], even, acc[r][v]));
      }
    }
    const bool first = k0 == 0 && !accumulate;
    for (int r = 0; r < kFloatMr; ++r) {
      float* cr = c + r * ldc;
      for (int v = 0; v < kVecs; ++v) {
        const __m256 prev = first ? _mm256_setzero_ps() : _mm256_loadu_ps(cr + 8 * v);
        if (!scales) {
          _mm256_storeu_ps(cr + 8 * v, _mm256_add_ps(prev, acc[r][v]));
          continue;
        }
        const float* cs = scales->col + blk * scales->col_block_stride;
        const __m256 col = scales->col_stride ? _mm256_loadu_ps(cs + 8 * v) : _mm256_set1_ps(cs[0]);
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(scales->row[r * scales->row_stride + blk]), col);
        _mm256_storeu_ps(cr + 8 * v, _mm256_fmadd_ps(acc[r][v], s, prev));
      }
    }
  }
}

// ---- int8 ------------------------------------------------------------------------------------

GLM5_TAVX2 inline void store_int(const __m256i* acc, int32_t* c, bool accumulate) {
  for (int v = 0; v < kVecs; ++v) {
    __m256i* cv = reinterpret_cast<__m256i*>(c + 8 * v);
    _mm256_storeu_si256(cv, accumulate ? _mm256_add_epi32(_mm256_loadu_si256(cv), acc[v]) : acc[v]);
  }
}

constexpr int kMaddMr = 2;

GLM5_TAVX2 void int8_madd_tile(const int8_t* a, int64_t lda, const int8_t* b, int64_t kc, int32_t* c, int64_t ldc,
                               bool accumulate) {
  __m256i acc[kMaddMr][kVecs];
  for (int r = 0; r < kMaddMr; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_setzero_si256();
  for (int64_t q = 0; q < kc / 4; ++q) {
    // per 32-bit lane, bytes k0..k3: even 16-bit halves hold k0, k2, odd ones k1, k3
    __m256i a_even[kMaddMr], a_odd[kMaddMr];
    for (int r = 0; r < kMaddMr; ++r) {
      const __m256i quad = _mm256_set1_epi32(load32(a + r * lda + 4 * q));
      a_even[r] = _mm256_srai_epi16(_mm256_slli_epi16(quad, 8), 8);
      a_odd[r] = _mm256_srai_epi16(quad, 8);
    }
    const int8_t* bq = b + q * 4 * kNr;
    for (int v = 0; v < kVecs; ++v) {
      const __m256i quads = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bq + 32 * v));
      const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(quads, 8), 8);
      const __m256i odd = _mm256_srai_epi16(quads, 8);
      for (int r = 0; r < kMaddMr; ++r)
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_add_epi32(_mm256_madd_epi16(a_even[r], even),
                                                                 _mm256_madd_epi16(a_odd[r], odd)));
    }
  }
  for (int r = 0; r < kMaddMr; ++r) store_int(acc[r], c + r * ldc, accumulate);
}

constexpr int kVnniMr = 3;

GLM5_TAVXVNNI void int8_vnni_tile(const int8_t* a, int64_t lda, const int8_t* b, int64_t kc, int32_t* c,
                                  int64_t ldc, bool accumulate) {
  __m256i acc[kVnniMr][kVecs];
  for (int r = 0; r < kVnniMr; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_setzero_si256();
  for (int64_t q = 0; q < kc / 4; ++q) {
    __m256i aq[kVnniMr];
    for (int r = 0; r < kVnniMr; ++r) aq[r] = _mm256_set1_epi32(load32(a + r * lda + 4 * q));  // x + 128
    const int8_t* bq = b + q * 4 * kNr;
    for (int v = 0; v < kVecs; ++v) {
      const __m256i quads = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bq + 32 * v));
      for (int r = 0; r < kVnniMr; ++r) acc[r][v] = _mm256_dpbusd_avx_epi32(acc[r][v], aq[r], quads);
    }
  }
  for (int r = 0; r < kVnniMr; ++r) store_int(acc[r], c + r * ldc, accumulate);
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

const FloatTile* avx2_float_tile() {
  static const FloatTile t{kAvx2, kFloatMr, pack_float_panel, fp8_to_bf16, nullptr, nullptr, float_tile, nullptr};
  static const bool ok = has_avx2();
  return ok ? &t : nullptr;
}

const Int8Tile* avx2_int8_tile() {
  static const Int8Tile t{kAvx2, kMaddMr, pack_int8_panel, nullptr, nullptr, false, int8_madd_tile};
  static const bool ok = has_avx2();
  return ok ? &t : nullptr;
}

const Int8Tile* avx_vnni_int8_tile() {
  static const Int8Tile t{kAvxVnni, kVnniMr, pack_int8_panel, nullptr, nullptr, true, int8_vnni_tile};
  static const bool ok = has_avx2() && __builtin_cpu_supports("avxvnni");
  return ok ? &t : nullptr;
}

}  // namespace glm5::qgemm

#endif  // GLM5_QGEMM_X86
