// Portable tier of the quantized GEMM tile kernels (plain loops the compiler vectorises for the
// baseline ISA), and the weight packing every tier shares.
#include <cmath>
#include <cstring>
#include <limits>

#include "qgemm_kernels.h"

namespace glm5::qgemm {

namespace {

constexpr int kPortableMr = 4;

inline float bf16_value(uint16_t h) { return bf16_to_f32(h); }

void portable_float(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* c, int64_t ldc,
                    bool accumulate, const BlockScales* scales) {
  const int64_t block_pairs = scales ? kScaleBlock / 2 : kc / 2;
  for (int r = 0; r < kPortableMr; ++r) {
    const uint16_t* ar = a + r * lda;
    float total[kNr];
    for (int j = 0; j < kNr; ++j) total[j] = accumulate ? c[r * ldc + j] : 0.0f;
    for (int64_t p0 = 0, blk = 0; p0 < kc / 2; p0 += block_pairs, ++blk) {
      float sum[kNr] = {};
      for (int64_t p = p0; p < p0 + block_pairs; ++p) {
        const float a0 = bf16_value(ar[2 * p]), a1 = bf16_value(ar[2 * p + 1]);
        const uint16_t* bp = b + p * 2 * kNr;
        for (int j = 0; j < kNr; ++j) sum[j] += a0 * bf16_value(bp[2 * j]) + a1 * bf16_value(bp[2 * j + 1]);
      }
      if (!scales) {
        for (int j = 0; j < kNr; ++j) total[j] += sum[j];
        continue;
      }
      const float rs = scales->row[r * scales->row_stride + blk];
      const float* cs = scales->col + blk * scales->col_block_stride;
      for (int j = 0; j < kNr; ++j) total[j] += sum[j] * (rs * cs[scales->col_stride ? j : 0]);
    }
    for (int j = 0; j < kNr; ++j) c[r * ldc + j] = total[j];
  }
}

void portable_int8(const int8_t* a, int64_t lda, const int8_t* b, int64_t kc, int32_t* c, int64_t ldc,
                   bool accumulate) {
  for (int r = 0; r < kPortableMr; ++r) {
    const int8_t* ar = a + r * lda;
    // uint32: wrapping arithmetic, as the vector tiers' int32 lanes (the driver keeps the true
    // sums within int32, so nothing wraps for valid inputs)
    uint32_t acc[kNr];
    for (int j = 0; j < kNr; ++j) acc[j] = accumulate ? static_cast<uint32_t>(c[r * ldc + j]) : 0u;
    for (int64_t q = 0; q < kc / 4; ++q) {
      const int8_t* bq = b + q * 4 * kNr;
      for (int j = 0; j < kNr; ++j) {
        int32_t dot = 0;
        for (int t = 0; t < 4; ++t) dot += static_cast<int32_t>(ar[4 * q + t]) * bq[4 * j + t];
        acc[j] += static_cast<uint32_t>(dot);
      }
    }
    for (int j = 0; j < kNr; ++j) c[r * ldc + j] = static_cast<int32_t>(acc[j]);
  }
}

}  // namespace

const FloatTile& portable_float_tile() {
  static const FloatTile t{kPortable, kPortableMr, pack_float_panel, fp8_to_bf16, nullptr, nullptr, portable_float,
                           nullptr};
  return t;
}

const Int8Tile& portable_int8_tile() {
  static const Int8Tile t{kPortable, kPortableMr, pack_int8_panel, nullptr, nullptr, false, portable_int8};
  return t;
}

const uint16_t* fp8_bf16_table() {
  static const struct Table {
    uint16_t v[256];
    Table() {
      for (unsigned code = 0; code < 256; ++code) {
        const unsigned mag = code & 0x7fu, e = mag >> 3, m = mag & 7u;
        float f;
        if (mag == 0x7fu) f = std::numeric_limits<float>::quiet_NaN();
        else if (e == 0) f = std::ldexp(static_cast<float>(m), -9);                      // subnormal
        else f = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, static_cast<int>(e) - 7);
        v[code] = f32_to_bf16((code & 0x80u) ? -f : f);                                  // exact
      }
    }
  } table;
  return table.v;
}

void fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst) {
  const uint16_t* table = fp8_bf16_table();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
}

void pack_float_panel(const void* w, DType wd, int64_t w_stride, int64_t n, int64_t k, int64_t n0, int64_t k0,
                      int64_t kc, uint16_t* panel) {
  const uint16_t* table = fp8_bf16_table();
  const int64_t kend = k0 + kc < k ? k0 + kc : k;
  for (int j = 0; j < kNr; ++j) {
    const int64_t row = n0 + j;
    uint16_t* dst = panel + 2 * j;   // element (k0 + i) of column j at dst[(i / 2) * 64 + i % 2]
    int64_t i = 0;
    if (row < n && kend > k0) {
      if (wd == DType::F8E4M3) {
        const uint8_t* src = static_cast<const uint8_t*>(w) + row * w_stride + k0;
        for (; i < kend - k0; ++i) dst[(i >> 1) * 2 * kNr + (i & 1)] = table[src[i]];
      } else {  // BF16
        const uint16_t* src = static_cast<const uint16_t*>(w) + row * w_stride + k0;
        for (; i < kend - k0; ++i) dst[(i >> 1) * 2 * kNr + (i & 1)] = src[i];
      }
    }
    for (; i < kc; ++i) dst[(i >> 1) * 2 * kNr + (i & 1)] = 0;
  }
}

void pack_int8_panel(const int8_t* w, int64_t w_stride, int64_t n, int64_t k, int64_t n0, int64_t k0, int64_t kc,
                     int8_t* panel, int32_t* col_sum) {
  const int64_t kend = k0 + kc < k ? k0 + kc : k;
  for (int j = 0; j < kNr; ++j) {
    const int64_t row = n0 + j;
    int8_t* dst = panel + 4 * j;     // element (k0 + i) of column j at dst[(i / 4) * 128 + i % 4]
    int64_t i = 0;
    int32_t sum = 0;
    if (row < n && kend > k0) {
      const int8_t* src = w + row * w_stride + k0;
      for (; i < kend - k0; ++i) {
        dst[(i >> 2) * 4 * kNr + (i & 3)] = src[i];
        sum += src[i];
      }
    }
    for (; i < kc; ++i) dst[(i >> 2) * 4 * kNr + (i & 3)] = 0;
    if (col_sum) col_sum[j] += sum;
  }
}

}  // namespace glm5::qgemm
