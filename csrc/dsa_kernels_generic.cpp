// Portable tier of the DSA tile kernels: QK and PV register-blocked with vector extensions
// (dsa_kernels_portable.h, compiled here for the baseline ISA: SSE2 on x86-64, NEON on
// aarch64), the small remaining kernels in plain C++.
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

}  // namespace

namespace scalar {

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

}  // namespace scalar

// Baseline: one 128-bit register per vector (16 on SSE2, 32 on NEON); the QK block keeps
// 8 accumulators, 4 query vectors and a broadcast in registers.
#define GLM5_VEC_FLOATS 4
#define GLM5_PORTABLE_FMA(a, b, c) ((a) * (b) + (c))
#define GLM5_QK_VECS 4
#define GLM5_QK_KEYS 2
#define GLM5_PV_VECS 2
#include "dsa_kernels_portable.h"

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
  static const Kernels k{0,       portable_qk_f32,        nullptr,          portable_softmax_tile, portable_pv_f32,
                         nullptr, scalar::indexer_reduce, scalar::to_f32, scalar::fp8_to_bf16};
  return k;
}

}  // namespace glm5::dsa
