// AVX-512 tiers of the DSA tile kernels. Every function that uses AVX-512 carries a target
// attribute (the file is compiled for baseline x86-64) and has internal linkage, so nothing
// compiled for AVX-512 can be picked by the linker for a caller on another CPU; the tables
// are handed out only after __builtin_cpu_supports says the CPU has the instructions.
//
// Register blocking (measured on Zen 5, 2 FMA pipes of 512 bits):
// - QK: a block of KB keys x NV column vectors of accumulators (KB * NV = 24) over the whole
//   head dim; each key element is a 32-bit broadcast straight from its cache row, the packed
//   Q^T vectors are reused across the KB keys.
// - PV: HB = 4 heads x DC value vectors; each value vector is loaded once per key and reused
//   across the 4 heads, the probability is a broadcast. bfloat16 values are widened in
//   registers: one 512-bit load of 32 values gives the even dims (shift left 16) and the odd
//   dims (mask the low half) as two fp32 vectors, hence the paired output layout.
#include "dsa_kernels.h"

#if GLM5_DSA_X86

#include <immintrin.h>

// GCC 12 reports the deliberately undefined lanes inside its own AVX-512 intrinsic headers
// (_mm512_undefined_*) as maybe-uninitialized at every inlined use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#define GLM5_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")))
#define GLM5_T512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,avx2")))

namespace glm5::dsa {

namespace {

GLM5_T512 inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n < 0 ? 0 : n)) - 1u);
}

GLM5_T512 inline __mmask32 lane_mask32(int64_t n) {
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1ull << (n < 0 ? 0 : n)) - 1ull);
}

// ---- QK ---------------------------------------------------------------------------------

template <int NV, int KB>
GLM5_T512 inline void qk_f32_block(const float* qt, const float* const* r, int64_t dim, float* s, int nstore) {
  constexpr int NC = NV * kLanes;
  __m512 acc[KB][NV];
#pragma GCC unroll 24
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    __m512 q[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qt + d * NC + v * kLanes);
#pragma GCC unroll 24
    for (int k = 0; k < KB; ++k) {
      const __m512 b = _mm512_set1_ps(r[k][d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_fmadd_ps(q[v], b, acc[k][v]);
    }
  }
#pragma GCC unroll 24
  for (int k = 0; k < KB; ++k)
    if (k < nstore)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + k * NC + v * kLanes, acc[k][v]);
}

template <int NV>
GLM5_T512 void qk_f32_nv(const float* qt, const float* const* rows, int nkeys, int64_t dim, float* s) {
  constexpr int KB = 24 / NV;
  for (int k0 = 0; k0 < nkeys; k0 += KB) {
    const int n = std::min(KB, nkeys - k0);
    const float* r[KB];
    // a short last block recomputes its last key instead of reading past the tile
    for (int i = 0; i < KB; ++i) r[i] = rows[k0 + std::min(i, n - 1)];
    qk_f32_block<NV, KB>(qt, r, dim, s + static_cast<int64_t>(k0) * NV * kLanes, n);
  }
}

GLM5_T512 void qk_f32(const float* qt, int nvec, const float* const* rows, int nkeys, int64_t dim, float* s) {
  switch (nvec) {
    case 1: qk_f32_nv<1>(qt, rows, nkeys, dim, s); return;
    case 2: qk_f32_nv<2>(qt, rows, nkeys, dim, s); return;
    case 3: qk_f32_nv<3>(qt, rows, nkeys, dim, s); return;
    default: qk_f32_nv<4>(qt, rows, nkeys, dim, s); return;
  }
}

template <int NV, int KB>
GLM5_T512BF16 inline void qk_bf16_block(const uint32_t* qp, const uint16_t* const* r, int64_t dim, float* s,
                                        int nstore) {
  constexpr int NC = NV * kLanes;
  __m512 acc[KB][NV];
#pragma GCC unroll 24
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_setzero_ps();
  const int64_t npairs = dim / 2;
  for (int64_t p = 0; p < npairs; ++p) {
    __m512bh q[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qp + p * NC + v * kLanes);
#pragma GCC unroll 24
    for (int k = 0; k < KB; ++k) {
      uint32_t pair;
      std::memcpy(&pair, r[k] + 2 * p, sizeof pair);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], q[v], b);
    }
  }
  if (dim & 1) {  // the last element pairs with 0 (never read past the row)
    __m512bh q[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qp + npairs * NC + v * kLanes);
#pragma GCC unroll 24
    for (int k = 0; k < KB; ++k) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(r[k][dim - 1]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], q[v], b);
    }
  }
#pragma GCC unroll 24
  for (int k = 0; k < KB; ++k)
    if (k < nstore)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + k * NC + v * kLanes, acc[k][v]);
}

template <int NV>
GLM5_T512BF16 void qk_bf16_nv(const uint32_t* qp, const uint16_t* const* rows, int nkeys, int64_t dim, float* s) {
  constexpr int KB = 24 / NV;
  for (int k0 = 0; k0 < nkeys; k0 += KB) {
    const int n = std::min(KB, nkeys - k0);
    const uint16_t* r[KB];
    for (int i = 0; i < KB; ++i) r[i] = rows[k0 + std::min(i, n - 1)];
    qk_bf16_block<NV, KB>(qp, r, dim, s + static_cast<int64_t>(k0) * NV * kLanes, n);
  }
}

GLM5_T512BF16 void qk_bf16(const uint32_t* qp, int nvec, const uint16_t* const* rows, int nkeys, int64_t dim,
                           float* s) {
  switch (nvec) {
    case 1: qk_bf16_nv<1>(qp, rows, nkeys, dim, s); return;
    case 2: qk_bf16_nv<2>(qp, rows, nkeys, dim, s); return;
    case 3: qk_bf16_nv<3>(qp, rows, nkeys, dim, s); return;
    default: qk_bf16_nv<4>(qp, rows, nkeys, dim, s); return;
  }
}

// ---- softmax ----------------------------------------------------------------------------

// exp(x) to ~1 ulp: x = n ln2 + r (Cody-Waite split of ln2), Cephes' minimax polynomial for
// exp(r) on |r| <= ln2/2, then scalef by 2^n (exact, and underflows to 0 gracefully).
GLM5_T512 inline __m512 exp512(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.8f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 result = _mm512_scalef_ps(y, n);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(result, nan, x);
}

GLM5_T512 void softmax_tile(float* s, int nkeys, int ncols, float scale, float* m, float* l, float* alpha) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int c = 0; c < ncols; c += kLanes) {
    __m512 mx = ninf;
    for (int k = 0; k < nkeys; ++k) mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(s + k * ncols + c), vscale));
    const __m512 m_old = _mm512_loadu_ps(m + c);
    const __m512 m_new = _mm512_max_ps(m_old, mx);
    const __mmask16 started = _mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_UQ);
    const __m512 a = _mm512_maskz_mov_ps(started, exp512(_mm512_sub_ps(m_old, m_new)));
    // all scores -inf so far: exp(-inf - 0) = 0 rather than exp(-inf + inf) = nan, as the reference
    const __m512 shift = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_new, ninf, _CMP_NEQ_UQ), m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < nkeys; ++k) {
      const __m512 p = exp512(_mm512_fmsub_ps(_mm512_loadu_ps(s + k * ncols + c), vscale, shift));
      _mm512_storeu_ps(s + k * ncols + c, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(l + c, _mm512_fmadd_ps(_mm512_loadu_ps(l + c), a, sum));
    _mm512_storeu_ps(m + c, m_new);
    _mm512_storeu_ps(alpha + c, a);
  }
}

// ---- PV ---------------------------------------------------------------------------------

constexpr int kHB = 4;  // heads per PV register block

template <int DC>
GLM5_T512 inline void pv_f32_block(const float* p, int ncols, int h0, const float* const* rows, int nkeys,
                                   int64_t d0, int64_t dv, float* o, int64_t os, const float* alpha) {
  __m512 acc[kHB][DC];
  __mmask16 mask[DC];
#pragma GCC unroll 8
  for (int c = 0; c < DC; ++c) mask[c] = lane_mask(dv - d0 - c * kLanes);
#pragma GCC unroll 4
  for (int h = 0; h < kHB; ++h) {
    const __m512 a = _mm512_set1_ps(alpha[h0 + h]);
#pragma GCC unroll 8
    for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (h0 + h) * os + d0 + c * kLanes), a);
  }
  for (int k = 0; k < nkeys; ++k) {
    const float* r = rows[k] + d0;
    __m512 v[DC];
#pragma GCC unroll 8
    for (int c = 0; c < DC; ++c) v[c] = _mm512_maskz_loadu_ps(mask[c], r + c * kLanes);
    const float* pk = p + static_cast<int64_t>(k) * ncols + h0;
#pragma GCC unroll 4
    for (int h = 0; h < kHB; ++h) {
      const __m512 b = _mm512_set1_ps(pk[h]);
#pragma GCC unroll 8
      for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_fmadd_ps(b, v[c], acc[h][c]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kHB; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(o + (h0 + h) * os + d0 + c * kLanes, acc[h][c]);
}

GLM5_T512 void pv_f32(const float* p, int ncols, const float* const* rows, int nkeys, int64_t dv, float* o,
                      int64_t os, const float* alpha) {
  constexpr int64_t kStep = 5 * kLanes;
  for (int64_t d0 = 0; d0 < dv; d0 += kStep) {
    const int64_t nvec = std::min<int64_t>(5, (dv - d0 + kLanes - 1) / kLanes);
    for (int h0 = 0; h0 < ncols; h0 += kHB) {
      switch (nvec) {
        case 1: pv_f32_block<1>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
        case 2: pv_f32_block<2>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
        case 3: pv_f32_block<3>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
        case 4: pv_f32_block<4>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
        default: pv_f32_block<5>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
      }
    }
  }
}

template <int DC>
GLM5_T512 inline void pv_bf16_block(const float* p, int ncols, int h0, const uint16_t* const* rows, int nkeys,
                                    int64_t d0, int64_t dv, float* o, int64_t os, const float* alpha) {
  __m512 acc[kHB][DC][2];
  __mmask32 mask[DC];
#pragma GCC unroll 4
  for (int c = 0; c < DC; ++c) mask[c] = lane_mask32(dv - d0 - c * kDvBlock);
#pragma GCC unroll 4
  for (int h = 0; h < kHB; ++h) {
    const __m512 a = _mm512_set1_ps(alpha[h0 + h]);
#pragma GCC unroll 4
    for (int c = 0; c < DC; ++c) {
      const float* oc = o + (h0 + h) * os + d0 + c * kDvBlock;
      acc[h][c][0] = _mm512_mul_ps(_mm512_loadu_ps(oc), a);
      acc[h][c][1] = _mm512_mul_ps(_mm512_loadu_ps(oc + kLanes), a);
    }
  }
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int k = 0; k < nkeys; ++k) {
    const uint16_t* r = rows[k] + d0;
    __m512 even[DC], odd[DC];
#pragma GCC unroll 4
    for (int c = 0; c < DC; ++c) {
      const __m512i x = _mm512_maskz_loadu_epi16(mask[c], r + c * kDvBlock);
      even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      odd[c] = _mm512_castsi512_ps(_mm512_and_si512(x, high_half));
    }
    const float* pk = p + static_cast<int64_t>(k) * ncols + h0;
#pragma GCC unroll 4
    for (int h = 0; h < kHB; ++h) {
      const __m512 b = _mm512_set1_ps(pk[h]);
#pragma GCC unroll 4
      for (int c = 0; c < DC; ++c) {
        acc[h][c][0] = _mm512_fmadd_ps(b, even[c], acc[h][c][0]);
        acc[h][c][1] = _mm512_fmadd_ps(b, odd[c], acc[h][c][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kHB; ++h)
#pragma GCC unroll 4
    for (int c = 0; c < DC; ++c) {
      float* oc = o + (h0 + h) * os + d0 + c * kDvBlock;
      _mm512_storeu_ps(oc, acc[h][c][0]);
      _mm512_storeu_ps(oc + kLanes, acc[h][c][1]);
    }
}

GLM5_T512 void pv_bf16(const float* p, int ncols, const uint16_t* const* rows, int nkeys, int64_t dv, float* o,
                       int64_t os, const float* alpha) {
  constexpr int64_t kStep = 3 * kDvBlock;
  for (int64_t d0 = 0; d0 < dv; d0 += kStep) {
    const int64_t nblk = std::min<int64_t>(3, (dv - d0 + kDvBlock - 1) / kDvBlock);
    for (int h0 = 0; h0 < ncols; h0 += kHB) {
      switch (nblk) {
        case 1: pv_bf16_block<1>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
        case 2: pv_bf16_block<2>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
        default: pv_bf16_block<3>(p, ncols, h0, rows, nkeys, d0, dv, o, os, alpha); break;
      }
    }
  }
}

// ---- indexer epilogue -------------------------------------------------------------------

GLM5_T512 void indexer_reduce(const float* s, int nkeys, int nvec, const int* vec_slot, const int* vec_lanes,
                              const float* w, const float* key_scale, float* const* out) {
  const int ncols = nvec * kLanes;
  __m512 wv[kMaxVecs];
  __mmask16 lanes[kMaxVecs];
  bool last[kMaxVecs];
  for (int v = 0; v < nvec; ++v) {
    lanes[v] = lane_mask(vec_lanes[v]);
    wv[v] = _mm512_maskz_loadu_ps(lanes[v], w + v * kLanes);
    last[v] = v + 1 == nvec || vec_slot[v + 1] != vec_slot[v];
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int k = 0; k < nkeys; ++k) {
    const float* sk = s + static_cast<int64_t>(k) * ncols;
    __m512 sum = zero;
    for (int v = 0; v < nvec; ++v) {
      __m512 x = _mm512_loadu_ps(sk + v * kLanes);
      if (key_scale) x = _mm512_mul_ps(x, _mm512_set1_ps(key_scale[k]));
      // max(0, x) returns x when x is nan (relu keeps nan); padding lanes become 0
      x = _mm512_maskz_max_ps(lanes[v], zero, x);
      sum = _mm512_fmadd_ps(x, wv[v], sum);
      if (last[v]) {
        out[vec_slot[v]][k] += _mm512_reduce_add_ps(sum);
        sum = zero;
      }
    }
  }
}

// ---- conversions ------------------------------------------------------------------------

// e4m3fn -> bfloat16 bits by table: the bfloat16 patterns of the 128 magnitudes live in four
// registers; vpermt2w looks up the low 6 bits in a pair of them (it ignores the higher bits),
// bit 6 picks the pair, the sign moves from bit 7 to bit 15. Exact, nan included.
struct Fp8Table {
  __m512i t0, t1, t2, t3;
};

GLM5_T512 inline Fp8Table fp8_bf16_table() {
  static const struct Bits {
    uint16_t v[128];
    Bits() {
      const float* table = fp8_table();
      for (int i = 0; i < 128; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &table[i], sizeof bits);
        v[i] = static_cast<uint16_t>(bits >> 16);
      }
    }
  } bits;
  return {_mm512_loadu_si512(bits.v), _mm512_loadu_si512(bits.v + 32), _mm512_loadu_si512(bits.v + 64),
          _mm512_loadu_si512(bits.v + 96)};
}

GLM5_T512 inline __m512i fp8x32_to_bf16(__m512i x, const Fp8Table& t) {  // x: bytes in 16-bit lanes
  const __m512i lo = _mm512_permutex2var_epi16(t.t0, x, t.t1);
  const __m512i hi = _mm512_permutex2var_epi16(t.t2, x, t.t3);
  const __m512i r = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
  // r | ((x << 8) & 0x8000)
  return _mm512_ternarylogic_epi32(r, _mm512_slli_epi16(x, 8), _mm512_set1_epi16(static_cast<short>(0x8000)), 0xf8);
}

GLM5_T512 void fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst) {
  const Fp8Table t = fp8_bf16_table();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(dst + i, fp8x32_to_bf16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(
                                                    reinterpret_cast<const __m256i*>(src + i))), t));
  if (i < n) {
    const __mmask32 m = lane_mask32(n - i);
    _mm512_mask_storeu_epi16(dst + i, m, fp8x32_to_bf16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, src + i)), t));
  }
}

GLM5_T512 void to_f32(DType dtype, const void* src, int64_t n, float* dst) {
  switch (dtype) {
    case DType::F32: std::memcpy(dst, src, sizeof(float) * n); return;
    case DType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 m = lane_mask(n - i);
        _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p + i)));
      }
      return;
    }
    case DType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 m = lane_mask(n - i);
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p + i));
        _mm512_mask_storeu_ps(dst + i, m, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
      }
      return;
    }
    case DType::F8E4M3: {
      const uint8_t* p = static_cast<const uint8_t*>(src);
      const Fp8Table t = fp8_bf16_table();
      for (int64_t i = 0; i < n; i += 32) {
        const __mmask32 m = lane_mask32(n - i);
        const __m512i h = fp8x32_to_bf16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p + i)), t);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
        const __m512 hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        _mm512_mask_storeu_ps(dst + i, static_cast<__mmask16>(m), lo);
        _mm512_mask_storeu_ps(dst + i + 16, static_cast<__mmask16>(m >> 16), hi);
      }
      return;
    }
    default: return;
  }
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
}

bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

}  // namespace

const Kernels* avx512_kernels() {
  static const Kernels k{2, qk_f32, nullptr, softmax_tile, pv_f32, pv_bf16, indexer_reduce, to_f32, fp8_to_bf16};
  static const bool ok = has_avx512();
  return ok ? &k : nullptr;
}

const Kernels* avx512_bf16_kernels() {
  static const Kernels k{3, qk_f32, qk_bf16, softmax_tile, pv_f32, pv_bf16, indexer_reduce, to_f32, fp8_to_bf16};
  static const bool ok = has_avx512_bf16();
  return ok ? &k : nullptr;
}

}  // namespace glm5::dsa

#endif  // GLM5_DSA_X86
