// AVX-512 tier of the quantized GEMM tiles: bfloat16 pairs with vdpbf16ps (AVX-512 BF16) and
// int8 quads with vpdpbusd (AVX-512 VNNI). Register blocking: 12 rows x 32 columns (24 zmm
// accumulators, the two panel vectors of a K step, one broadcast of the row's K pair / quad).
// The bfloat16 grouped GEMM has its own kernel here (bf16_dot_rows: 4 x 6 dot-product tiles on
// both operands in place, no packing).
// Every function carries a target attribute and has internal linkage (the file is compiled for
// baseline x86-64); the tables are handed out only when the CPU has the instructions.
//
// vdpbf16ps ignores MXCSR: bfloat16 subnormal inputs (|x| < 2^-126) count as 0 and subnormal
// results flush to 0. FP8 values are never bfloat16 subnormals (the smallest e4m3 is 2^-9);
// for bfloat16 inputs the flushed contributions are below 2^-126 each.
#include "qgemm_kernels.h"

#if GLM5_QGEMM_X86

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

// GCC 12 reports the deliberately undefined lanes inside its own AVX-512 intrinsic headers
// (_mm512_undefined_*) as (maybe-)uninitialized at every inlined use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#define GLM5_T512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")))
#define GLM5_T512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2")))
#define GLM5_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2")))

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
GLM5_T512BF16 inline void flush_float(__m512 (&acc)[MR][2], float* c, int64_t ldc, bool first,
                                      const BlockScales* scales, int64_t blk) {
  __m512 col[2];
  if (scales) {
    const float* cs = scales->col + blk * scales->col_block_stride;
    for (int v = 0; v < 2; ++v) col[v] = scales->col_stride ? _mm512_loadu_ps(cs + 16 * v) : _mm512_set1_ps(cs[0]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cr + 16 * v);
      const __m512 sum =
          scales ? _mm512_fmadd_ps(acc[r][v],
                                   _mm512_mul_ps(_mm512_set1_ps(scales->row[r * scales->row_stride + blk]), col[v]),
                                   prev)
                 : _mm512_add_ps(prev, acc[r][v]);
      _mm512_storeu_ps(cr + 16 * v, sum);
    }
  }
}

GLM5_T512BF16 void float_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* c, int64_t ldc,
                              bool accumulate, const BlockScales* scales) {
  const int64_t step = scales ? kScaleBlock : kc;
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
    flush_float<kMr>(acc, c, ldc, k0 == 0 && !accumulate, scales, blk);
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

// ---- packing and conversion -------------------------------------------------------------------

// e4m3fn -> bfloat16 by table: the bfloat16 patterns of the 128 magnitudes in four registers;
// vpermt2w looks up the low 6 bits in a pair of them (it ignores the higher bits), bit 6
// picks the pair, the sign moves from bit 7 to bit 15. Exact, nan included.
struct Fp8Lut {
  __m512i t0, t1, t2, t3;
};

GLM5_T512 inline Fp8Lut fp8_lut() {
  const uint16_t* v = fp8_bf16_table();   // entries 0..127: the positive magnitudes
  return {_mm512_loadu_si512(v), _mm512_loadu_si512(v + 32), _mm512_loadu_si512(v + 64),
          _mm512_loadu_si512(v + 96)};
}

GLM5_T512 inline __m512i fp8x32_to_bf16(__m256i bytes, const Fp8Lut& t) {
  const __m512i x = _mm512_cvtepu8_epi16(bytes);
  const __m512i lo = _mm512_permutex2var_epi16(t.t0, x, t.t1);
  const __m512i hi = _mm512_permutex2var_epi16(t.t2, x, t.t3);
  const __m512i r = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
  // r | ((x << 8) & 0x8000)
  return _mm512_ternarylogic_epi32(r, _mm512_slli_epi16(x, 8), _mm512_set1_epi16(static_cast<short>(0x8000)), 0xf8);
}

inline __mmask32 mask32(int64_t n) {
  return n >= 32 ? 0xffffffffu : n <= 0 ? 0u : static_cast<__mmask32>((uint64_t{1} << n) - 1);
}
inline __mmask64 mask64(int64_t n) { return n >= 64 ? ~uint64_t{0} : n <= 0 ? 0 : (uint64_t{1} << n) - 1; }

// ---- bfloat16 rows against bfloat16 rows, both read in place -------------------------------------
// The bfloat16 grouped GEMM's kernel on this tier: x rows and weight rows are both contiguous
// along K, so each zmm accumulator takes 32 products of one (row, weight row) pair per
// vdpbf16ps (16 lanes of K pairs) and is reduced once, after all of K. No packing of either
// operand: the weights stream from memory straight into the loop.
//
// Register tile: 4 x rows by 6 weight rows, 24 accumulators, the 4 x vectors of a 32-K step in
// registers and each weight vector read once per step (10 loads per 24 vdpbf16ps). The x rows
// of one call (at most a few hundred KiB) stay in L2 while the weight tiles pass by: a weight
// tile (6 rows over all of K) is read from memory once, by the first row tile, and from L2 by
// the others; while one weight tile is in use the next one is prefetched into L2, one row per
// row tile, so that its memory traffic is spread over the whole tile's compute.
//
// Every element is the same computation wherever it falls (tile position, tails, thread
// split): lane l of its accumulator sums the products at K = 32 s + 2 l and 32 s + 2 l + 1 over
// the steps s in order (the K tail's missing elements loaded as zeros), then the 16 lanes are
// added by _mm512_reduce_add_ps's fixed tree.
constexpr int kDotMr = 4;
constexpr int kDotNr = 6;

template <int MR, int NR>
GLM5_T512BF16 void dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k, float* c,
                            int64_t ldc, const uint16_t* prefetch, int64_t prefetch_rows) {
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 6
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t k_whole = k & ~int64_t{31};
  int64_t k0 = 0;
  for (; k0 < k_whole; k0 += 32) {
    for (int64_t r = 0; r < prefetch_rows; ++r)   // one cache line of each row per step
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + r * ldw + k0), _MM_HINT_T1);
    __m512bh xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * ldx + k0);
#pragma GCC unroll 6
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * ldw + k0);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
  if (k0 < k) {   // the K tail: elements past K load as zeros
    const __mmask32 m = mask32(k - k0);
    __m512bh xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * ldx + k0);
#pragma GCC unroll 6
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * ldw + k0);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 6
    for (int j = 0; j < NR; ++j) c[i * ldc + j] = _mm512_reduce_add_ps(acc[i][j]);
}

using DotTile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                         const uint16_t*, int64_t);

template <int MR, int... NR>
constexpr std::array<DotTile, kDotNr> dot_tile_row(std::integer_sequence<int, NR...>) {
  return {dot_tile<MR, NR + 1>...};
}

// kDotTiles[mr - 1][nr - 1]: the tile of mr x rows by nr weight rows (the tails' tiles too).
constexpr std::array<std::array<DotTile, kDotNr>, kDotMr> kDotTiles{
    dot_tile_row<1>(std::make_integer_sequence<int, kDotNr>{}),
    dot_tile_row<2>(std::make_integer_sequence<int, kDotNr>{}),
    dot_tile_row<3>(std::make_integer_sequence<int, kDotNr>{}),
    dot_tile_row<4>(std::make_integer_sequence<int, kDotNr>{})};

GLM5_T512BF16 void bf16_dot_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* w, int64_t ldw,
                                 int64_t n, int64_t k, float* c, int64_t ldc) {
  const int64_t row_tiles = (m + kDotMr - 1) / kDotMr;
  for (int64_t j0 = 0; j0 < n; j0 += kDotNr) {
    const int64_t nr = std::min<int64_t>(kDotNr, n - j0);
    const int64_t next = j0 + kDotNr, next_rows = std::max<int64_t>(0, std::min<int64_t>(kDotNr, n - next));
    for (int64_t t = 0; t < row_tiles; ++t) {
      const int64_t i0 = t * kDotMr, mr = std::min<int64_t>(kDotMr, m - i0);
      // row tile t prefetches row t of the next weight tile; the last one all rows left
      const int64_t pf_first = std::min(t, next_rows);
      const int64_t pf_end = t + 1 < row_tiles ? std::min(t + 1, next_rows) : next_rows;
      kDotTiles[mr - 1][nr - 1](x + i0 * ldx, ldx, w + j0 * ldw, ldw, k, c + i0 * ldc + j0, ldc,
                                pf_end > pf_first ? w + (next + pf_first) * ldw : nullptr, pf_end - pf_first);
    }
  }
}


// in[0..15]: 16 rows of 16 dwords -> out[i] = dword i of every row (a 16 x 16 transpose).
GLM5_T512 inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {   // u[4i + j], 128-bit lane L: dword 4L + j of rows 4i..4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    out[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[8 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    out[4 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// 32 rows of 16 dwords (row j of the chunk in rows[j]) -> 16 panel rows of 32 dwords at dst
// (dst row p = dword p of rows 0..31).
GLM5_T512 inline void store_transposed(const __m512i* rows, uint32_t* dst) {
  __m512i cols[16];
  for (int half = 0; half < 2; ++half) {
    transpose16(rows + 16 * half, cols);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * kNr + 16 * half, cols[p]);
  }
}

}  // namespace

GLM5_T512 void avx512_fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst) {
  const Fp8Lut t = fp8_lut();
  for (int64_t i = 0; i < n; i += 32) {
    const __mmask32 m = mask32(n - i);
    _mm512_mask_storeu_epi16(dst + i, m, fp8x32_to_bf16(_mm256_maskz_loadu_epi8(m, src + i), t));
  }
}

GLM5_T512 void avx512_pack_float_panel(const void* w, DType wd, int64_t w_stride, int64_t n, int64_t k, int64_t n0,
                                       int64_t k0, int64_t kc, uint16_t* panel) {
  const Fp8Lut t = fp8_lut();
  const bool fp8 = wd == DType::F8E4M3;
  __m512i rows[kNr];
  for (int64_t kk = 0; kk < kc; kk += 32) {   // 32 K values: 16 pairs per row
    const int64_t valid = k - (k0 + kk);
    for (int j = 0; j < kNr; ++j) {
      const int64_t row = n0 + j;
      if (row >= n || valid <= 0) {
        rows[j] = _mm512_setzero_si512();
      } else if (fp8) {
        const uint8_t* src = static_cast<const uint8_t*>(w) + row * w_stride + k0 + kk;
        rows[j] = fp8x32_to_bf16(_mm256_maskz_loadu_epi8(mask32(valid), src), t);
      } else {
        const uint16_t* src = static_cast<const uint16_t*>(w) + row * w_stride + k0 + kk;
        rows[j] = _mm512_maskz_loadu_epi16(mask32(valid), src);
      }
    }
    store_transposed(rows, reinterpret_cast<uint32_t*>(panel + kk * kNr));
  }
}

GLM5_T512 void avx512_pack_int8_panel(const int8_t* w, int64_t w_stride, int64_t n, int64_t k, int64_t n0,
                                      int64_t k0, int64_t kc, int8_t* panel, int32_t* col_sum) {
  __m512i rows[kNr];
  __m512i sums[kNr];   // per row: sums of (x + 128) over 8-byte groups, 8 x int64
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int j = 0; j < kNr; ++j) sums[j] = _mm512_setzero_si512();
  int64_t loaded = 0;   // bytes per row summed (every lane, masked ones as 0 + 128)
  for (int64_t kk = 0; kk < kc; kk += 64) {   // 64 K values: 16 quads per row
    const int64_t valid = k - (k0 + kk);
    for (int j = 0; j < kNr; ++j) {
      const int64_t row = n0 + j;
      rows[j] = row >= n || valid <= 0 ? _mm512_setzero_si512()
                                       : _mm512_maskz_loadu_epi8(mask64(valid), w + row * w_stride + k0 + kk);
      if (col_sum) sums[j] = _mm512_add_epi64(sums[j], _mm512_sad_epu8(_mm512_xor_si512(rows[j], flip),
                                                                         _mm512_setzero_si512()));
    }
    loaded += 64;
    store_transposed(rows, reinterpret_cast<uint32_t*>(panel + kk * kNr));
  }
  if (col_sum)
    for (int j = 0; j < kNr; ++j) col_sum[j] += static_cast<int32_t>(_mm512_reduce_add_epi64(sums[j]) - 128 * loaded);
}

namespace {

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma");
}

}  // namespace

const FloatTile* avx512_float_tile() {
  static const FloatTile t{kAvx512, kMr, avx512_pack_float_panel, avx512_fp8_to_bf16, nullptr, nullptr, float_tile,
                           bf16_dot_rows};
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok ? &t : nullptr;
}

const Int8Tile* avx512_int8_tile() {
  static const Int8Tile t{kAvx512, kMr, avx512_pack_int8_panel, nullptr, nullptr, true, int8_tile};
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok ? &t : nullptr;
}

}  // namespace glm5::qgemm

#endif  // GLM5_QGEMM_X86
