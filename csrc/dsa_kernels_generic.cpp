// Portable tier of the DSA tile kernels: plain C++ with loops over columns innermost so the
// compiler vectorises them for whatever the baseline ISA is (SSE2 on x86-64, NEON on aarch64)
// without reassociating any floating-point sum.
#include <cmath>
#include <cstring>
#include <limits>

#include "dsa_kernels.h"

namespace glm5::dsa {

namespace {

float fp8_e4m3fn_value(unsigned v) {
  const unsigned mag = v & 0x7fu;
  const float sign = (v & 0x80u) ? -1.0f : 1.0f;
  if (mag == 0x7fu) return std::numeric_limits<float>::quiet_NaN();
  const unsigned e = mag >> 3, m = mag & 7u;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(m) / 8.0f, static_cast<int>(e) - 7);
}

void qk_f32(const float* qt, int nvec, const float* const* rows, int nkeys, int64_t dim, float* s) {
  const int ncols = nvec * kLanes;
  for (int k = 0; k < nkeys; ++k) {
    float acc[kMaxVecs * kLanes] = {};
    const float* row = rows[k];
    for (int64_t d = 0; d < dim; ++d) {
      const float kv = row[d];
      const float* q = qt + d * ncols;
      for (int c = 0; c < ncols; ++c) acc[c] += q[c] * kv;
    }
    std::memcpy(s + static_cast<int64_t>(k) * ncols, acc, sizeof(float) * ncols);
  }
}

void softmax_tile(float* s, int nkeys, int ncols, float scale, float* m, float* l, float* alpha) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int c = 0; c < ncols; ++c) {
    float mx = ninf;
    for (int k = 0; k < nkeys; ++k) mx = std::fmax(mx, s[k * ncols + c] * scale);
    const float m_new = std::fmax(m[c], mx);
    alpha[c] = m[c] == ninf ? 0.0f : std::exp(m[c] - m_new);
    // all scores -inf: exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan, as the reference
    const float shift = m_new == ninf ? 0.0f : m_new;
    float sum = 0.0f;
    for (int k = 0; k < nkeys; ++k) {
      const float p = std::exp(s[k * ncols + c] * scale - shift);
      s[k * ncols + c] = p;
      sum += p;
    }
    l[c] = l[c] * alpha[c] + sum;
    m[c] = m_new;
  }
}

void pv_f32(const float* p, int ncols, const float* const* rows, int nkeys, int64_t dv, float* o,
            int64_t o_stride, const float* alpha) {
  for (int h = 0; h < ncols; ++h) {
    float* oh = o + h * o_stride;
    const float a = alpha[h];
    for (int64_t d = 0; d < dv; ++d) oh[d] *= a;
    for (int k = 0; k < nkeys; ++k) {
      const float pk = p[k * ncols + h];
      const float* row = rows[k];
      for (int64_t d = 0; d < dv; ++d) oh[d] += pk * row[d];
    }
  }
}

void indexer_reduce(const float* s, int nkeys, int nvec, const int* vec_slot, const int* vec_lanes,
                    const float* w, const float* key_scale, float* const* out) {
  const int ncols = nvec * kLanes;
  for (int k = 0; k < nkeys; ++k) {
    const float* sk = s + static_cast<int64_t>(k) * ncols;
    const float sc = key_scale ? key_scale[k] : 1.0f;
    float sum = 0.0f;
    for (int v = 0; v < nvec; ++v) {
      for (int lane = 0; lane < vec_lanes[v]; ++lane) {
        float x = sk[v * kLanes + lane];
        if (key_scale) x *= sc;
        // relu that keeps NaN, as torch.relu does
        x = x < 0.0f ? 0.0f : x;
        sum += x * w[v * kLanes + lane];
      }
      if (v + 1 == nvec || vec_slot[v + 1] != vec_slot[v]) {
        out[vec_slot[v]][k] += sum;
        sum = 0.0f;
      }
    }
  }
}

void to_f32(DType dtype, const void* src, int64_t n, float* dst) {
  switch (dtype) {
    case DType::F32: std::memcpy(dst, src, sizeof(float) * n); return;
    case DType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(p[i]);
      return;
    }
    case DType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(p[i]);
      return;
    }
    case DType::F8E4M3: {
      const uint8_t* p = static_cast<const uint8_t*>(src);
      const float* table = fp8_table();
      for (int64_t i = 0; i < n; ++i) dst[i] = table[p[i]];
      return;
    }
    default: return;  // the drivers only pass the dtypes above
  }
}

void fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst) {
  const float* table = fp8_table();
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &table[src[i]], sizeof bits);
    dst[i] = static_cast<uint16_t>(bits >> 16);  // exact: 3 mantissa bits
  }
}

}  // namespace

const float* fp8_table() {
  static const struct Table {
    float v[256];
    Table() {
      for (unsigned i = 0; i < 256; ++i) v[i] = fp8_e4m3fn_value(i);
    }
  } table;
  return table.v;
}

const Kernels& generic_kernels() {
  static const Kernels k{0, qk_f32, nullptr, softmax_tile, pv_f32, nullptr, indexer_reduce, to_f32, fp8_to_bf16};
  return k;
}

}  // namespace glm5::dsa
