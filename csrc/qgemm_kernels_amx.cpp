// AMX tier of the quantized GEMM tiles: 32 x 32 output blocks as 2 x 2 tiles of 16 x 16, from
// two A tiles (16 rows x 64 bytes of the row-major activations) and two B tiles (16 K pairs /
// quads x 16 columns of the packed panel, row stride 128 bytes) per K step; tdpbf16ps for
// bfloat16 (FP8 converted exactly), tdpbssd for int8 x int8 (no unsigned bias needed).
// FP8: after each 128-K block the tiles are stored to a scratch block and added into C times
// their scales with AVX-512, then zeroed.
//
// Linux hands out the AMX tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM); the tables
// ask once and are null if it is refused. The tile configuration is per thread and other
// libraries (oneDNN) load their own, so every task loads it again (begin) and releases the
// tiles after (end). Like vdpbf16ps, tdpbf16ps treats bfloat16 subnormals as 0.
#include "qgemm_kernels.h"

#if GLM5_QGEMM_X86

#include <immintrin.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define GLM5_TAMX __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")))

namespace glm5::qgemm {

namespace {

constexpr int kMr = 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {   // 0-3: C, 4-5: A, 6-7: B; all 16 rows x 64 bytes
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  return cfg;
}

// Tile registers are not renamed: the next K step's loads wait for this step's products, so
// their data had better be in L1. The packed panel (from L2) is read sequentially, 2 KiB per
// K step: fetch the step two ahead (past a panel's end that is the next panel's start).
GLM5_TAMX inline void prefetch_ahead(const void* step) {
  const char* p = static_cast<const char*>(step) + 2 * 2048;
  for (int line = 0; line < 2048; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
}

// The A rows of the step two ahead (rows of a scratch in L2; the first panel of a row tile
// brings them into L1, the others find them there).
GLM5_TAMX inline void prefetch_rows_ahead(const void* step, int64_t stride_bytes) {
  const char* p = static_cast<const char*>(step) + 2 * 64;
  for (int r = 0; r < kMr; ++r) _mm_prefetch(p + r * stride_bytes, _MM_HINT_T0);
}

GLM5_TAMX void begin() { _tile_loadconfig(&tile_config()); }
GLM5_TAMX void end() { _tile_release(); }

// The 32 x 32 C block (4-byte elements, row stride ldc_bytes) from or into the four C tiles.
GLM5_TAMX inline void load_c(const void* c, int64_t ldc_bytes) {
  const char* p = static_cast<const char*>(c);
  _tile_loadd(0, p, ldc_bytes);
  _tile_loadd(1, p + 64, ldc_bytes);
  _tile_loadd(2, p + 16 * ldc_bytes, ldc_bytes);
  _tile_loadd(3, p + 16 * ldc_bytes + 64, ldc_bytes);
}

GLM5_TAMX inline void store_c(void* c, int64_t ldc_bytes) {
  char* p = static_cast<char*>(c);
  _tile_stored(0, p, ldc_bytes);
  _tile_stored(1, p + 64, ldc_bytes);
  _tile_stored(2, p + 16 * ldc_bytes, ldc_bytes);
  _tile_stored(3, p + 16 * ldc_bytes + 64, ldc_bytes);
}

GLM5_TAMX void float_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* c, int64_t ldc,
                          bool accumulate, const BlockScales* scales) {
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t b_stride = 2 * kNr * static_cast<int64_t>(sizeof(uint16_t));  // one K pair of 32 columns
  const int64_t c_stride = ldc * static_cast<int64_t>(sizeof(float));
  const int64_t step = scales ? kScaleBlock : kc;
  // FP8: the scaled total of this call's blocks stays in L1 (total), C is read and written once
  alignas(64) float block[kMr * kNr], total[kMr * kNr];
  if (scales) {
    for (int r = 0; r < kMr; ++r)
      for (int v = 0; v < 2; ++v)
        _mm512_store_ps(total + r * kNr + 16 * v, accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps());
  }
  for (int64_t k0 = 0, blk = 0; k0 < kc; k0 += step, ++blk) {
    if (!scales && accumulate) {
      load_c(c, c_stride);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kk = k0; kk < k0 + step; kk += kFloatKStep) {
      const uint16_t* bk = b + kk * kNr;   // K pair kk / 2 of the panel
      prefetch_ahead(bk);
      prefetch_rows_ahead(a + kk, a_stride);
      // loads interleaved with the products that use them: tiles are not renamed, so each load
      // waits only for the last product of the previous step that read its register
      _tile_loadd(4, a + kk, a_stride);
      _tile_loadd(6, bk, b_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, bk + kNr, b_stride);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + 16 * lda + kk, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (!scales) {
      store_c(c, c_stride);
      continue;
    }
    store_c(block, kNr * static_cast<int64_t>(sizeof(float)));
    const float* cs = scales->col + blk * scales->col_block_stride;
    __m512 col[2];
    for (int v = 0; v < 2; ++v) col[v] = scales->col_stride ? _mm512_loadu_ps(cs + 16 * v) : _mm512_set1_ps(cs[0]);
    for (int r = 0; r < kMr; ++r) {
      const __m512 rs = _mm512_set1_ps(scales->row[r * scales->row_stride + blk]);
      for (int v = 0; v < 2; ++v) {
        float* t = total + r * kNr + 16 * v;
        _mm512_store_ps(t, _mm512_fmadd_ps(_mm512_load_ps(block + r * kNr + 16 * v), _mm512_mul_ps(rs, col[v]),
                                           _mm512_load_ps(t)));
      }
    }
  }
  if (scales)
    for (int r = 0; r < kMr; ++r)
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, _mm512_load_ps(total + r * kNr + 16 * v));
}

GLM5_TAMX void int8_tile(const int8_t* a, int64_t lda, const int8_t* b, int64_t kc, int32_t* c, int64_t ldc,
                         bool accumulate) {
  const int64_t c_stride = ldc * static_cast<int64_t>(sizeof(int32_t));
  const int64_t b_stride = 4 * kNr;   // one K quad of 32 columns
  if (accumulate) {
    load_c(c, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kk = 0; kk < kc; kk += kIntKStep) {
    const int8_t* bk = b + kk * kNr;      // K quad kk / 4 of the panel
    prefetch_ahead(bk);
    prefetch_rows_ahead(a + kk, lda);
    _tile_loadd(4, a + kk, lda);
    _tile_loadd(6, bk, b_stride);
    _tile_dpbssd(0, 4, 6);
    _tile_loadd(7, bk + 2 * kNr, b_stride);
    _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + kk, lda);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  store_c(c, c_stride);
}

bool request_amx() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

bool amx_usable() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") && request_amx();
  }();
  return ok;
}

const FloatTile* amx_float_tile() {
  static const FloatTile t{kAmx, kMr, avx512_pack_float_panel, avx512_fp8_to_bf16, begin, end, float_tile, nullptr};
  return amx_usable() ? &t : nullptr;
}

const Int8Tile* amx_int8_tile() {
  static const Int8Tile t{kAmx, kMr, avx512_pack_int8_panel, begin, end, false, int8_tile};
  return amx_usable() ? &t : nullptr;
}

}  // namespace glm5::qgemm

#endif  // GLM5_QGEMM_X86
