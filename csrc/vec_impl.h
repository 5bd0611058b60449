// The row primitives of vec.h, written once and compiled per tier: included by vec_portable.cpp,
// vec_avx2.cpp and vec_avx512.cpp with GLM5_VEC_TIER set to 0, 1 or 2 after a
// `#pragma GCC target` for that tier. Everything here has internal linkage (anonymous
// namespace), so no function compiled for a vector tier can be chosen by the linker for a
// caller on a CPU without it. Plain loops are written to be auto-vectorised (branch-free
// selects, `omp simd` reductions); only the float16 conversions use intrinsics (F16C), as
// their scalar form does not vectorise.
//
// Include order in the tier files: every system and project header first (compiled for the
// baseline), then the target pragma, then this file.
#ifndef GLM5_VEC_TIER
#error "define GLM5_VEC_TIER before including vec_impl.h"
#endif

namespace {

using glm5::DType;

inline uint32_t as_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet). Branch-free so that loops vectorise.
inline uint16_t bf16_round(float f) {
  const uint32_t b = as_bits(f);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (b >> 16) | 0x40u;
  return static_cast<uint16_t>((b & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

void load_row(DType dtype, const void* src, int64_t n, float* dst) {
  if (dtype == DType::F32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else if (dtype == DType::BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = as_float(static_cast<uint32_t>(s[i]) << 16);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t i = 0;
#if GLM5_VEC_TIER == 2
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
#elif GLM5_VEC_TIER == 1
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
    for (; i < n; ++i) dst[i] = glm5::f16_to_f32(s[i]);
  }
}

void store_row(DType dtype, const float* src, int64_t n, void* dst) {
  if (dtype == DType::F32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else if (dtype == DType::BF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_round(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    int64_t i = 0;
    // vcvtps2ph rounds to nearest even with gradual underflow and overflow to inf (IEEE),
    // as glm5::f32_to_f16 does.
#if GLM5_VEC_TIER == 2
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                          _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif GLM5_VEC_TIER == 1
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) d[i] = glm5::f32_to_f16(src[i]);
  }
}

void accumulate_row(DType dtype, const void* y, float a, int64_t n, float* acc) {
  if (dtype == DType::F32) {
    const float* s = static_cast<const float*>(y);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) acc[i] += a * s[i];
  } else if (dtype == DType::BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(y);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) acc[i] += a * as_float(static_cast<uint32_t>(s[i]) << 16);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(y);
    int64_t i = 0;
#if GLM5_VEC_TIER == 2
    const __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
      _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_mul_ps(va, v)));
    }
#elif GLM5_VEC_TIER == 1
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(va, v)));
    }
#endif
    for (; i < n; ++i) acc[i] += a * glm5::f16_to_f32(s[i]);
  }
}

template <typename T, typename Load>
inline void weighted_sum_chunk(const void* const* rows, const float* w, int64_t nrows, int64_t c, float* acc,
                               Load load) {
  constexpr int64_t kChunk = 128;
  for (int64_t i = 0; i < kChunk; ++i) acc[i] = 0.f;
  for (int64_t r = 0; r < nrows; ++r) {
    const T* y = static_cast<const T*>(rows[r]) + c;
    const float a = w[r];
#pragma omp simd
    for (int64_t i = 0; i < kChunk; ++i) acc[i] += a * load(y, i);
  }
}

void weighted_sum(DType dtype, const void* const* rows, const float* w, int64_t nrows, int64_t n, void* out) {
  // Full chunks of 128 columns accumulate in 8 (AVX-512) or 16 (AVX2) vector registers across
  // all rows, then round once; the tail goes through accumulate_row.
  constexpr int64_t kChunk = 128;
  alignas(64) float acc[kChunk];
  const int64_t es = glm5::dtype_bytes(dtype);
  char* ob = static_cast<char*>(out);
  int64_t c = 0;
  for (; c + kChunk <= n; c += kChunk) {
    if (dtype == DType::F32) {
      weighted_sum_chunk<float>(rows, w, nrows, c, acc, [](const float* y, int64_t i) { return y[i]; });
    } else if (dtype == DType::BF16) {
      weighted_sum_chunk<uint16_t>(rows, w, nrows, c, acc, [](const uint16_t* y, int64_t i) {
        return as_float(static_cast<uint32_t>(y[i]) << 16);
      });
    } else {
      for (int64_t i = 0; i < kChunk; ++i) acc[i] = 0.f;
      for (int64_t r = 0; r < nrows; ++r)
        accumulate_row(dtype, static_cast<const char*>(rows[r]) + c * es, w[r], kChunk, acc);
    }
    store_row(dtype, acc, kChunk, ob + c * es);
  }
  if (c < n) {
    const int64_t m = n - c;
    for (int64_t i = 0; i < m; ++i) acc[i] = 0.f;
    for (int64_t r = 0; r < nrows; ++r) accumulate_row(dtype, static_cast<const char*>(rows[r]) + c * es, w[r], m, acc);
    store_row(dtype, acc, m, ob + c * es);
  }
}

float sum_squares(const float* x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
  return acc;
}

float abs_max(const float* x, int64_t n) {
  // NaN propagates (as torch's amax does): a NaN element makes the result NaN.
  float m = 0.f;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    m = a > m ? a : m;
    nan |= (a != a);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

void scale_mul(float* x, const float* w, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * s * w[i];
}

// exp(x) for x in float32, within 2 ulp of the exact value for normal results (Cephes' expf
// polynomial on a Cody-Waite reduction), vectorisable; x is clamped to [-87.3, 88.7] (results
// stay normal and finite), which silu's use does not notice.
inline float exp_vec(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  const float t = x * 1.44269504088896341f;
  const float fn = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const float r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = static_cast<int32_t>(fn);
  // 2^e split in two factors so that e = 128 (x near 88.7) stays finite
  const int32_t e1 = e >> 1;
  return y * as_float(static_cast<uint32_t>(e1 + 127) << 23) * as_float(static_cast<uint32_t>(e - e1 + 127) << 23);
}

void sigmoid(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = 1.0f / (1.0f + exp_vec(-x[i]));
}

void silu_mul(float* gate, const float* up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + exp_vec(-g)) * up[i];
  }
}

void fwht(float* x, int64_t n, float scale) {
  // Stride 1 and 2 butterflies on groups of four, then the wider strides, whose inner loops
  // are long enough to vectorise.
  int64_t h = 1;
  if (n >= 4) {
    for (int64_t i = 0; i < n; i += 4) {
      const float a = x[i], b = x[i + 1], c = x[i + 2], d = x[i + 3];
      const float s0 = a + b, d0 = a - b, s1 = c + d, d1 = c - d;
      x[i] = s0 + s1;
      x[i + 1] = d0 + d1;
      x[i + 2] = s0 - s1;
      x[i + 3] = d0 - d1;
    }
    h = 4;
  }
  for (; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      float* lo = x + i;
      float* hi = x + i + h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) {
        const float a = lo[j], b = hi[j];
        lo[j] = a + b;
        hi[j] = a - b;
      }
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

void rope(float* x, const float* cos, const float* sin, int64_t half, bool interleaved) {
  if (interleaved) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * cos[i] - b * sin[i];
      x[2 * i + 1] = a * sin[i] + b * cos[i];
    }
  } else {
    float* hi = x + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = hi[i];
      x[i] = a * cos[i] - b * sin[i];
      hi[i] = a * sin[i] + b * cos[i];
    }
  }
}

// float32 -> float8_e4m3fn, round to nearest even, as c10's fp8_e4m3fn_from_fp32_value:
// magnitudes >= 480 (and nan) become nan (0x7f); callers clamp to +-448 first.
inline uint8_t fp8_e4m3(float f) {
  const uint32_t bits = as_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits ^ sign;
  // subnormal results: let the float adder round by aligning with 2^14 (0.5 ulp of e4m3 at 2^-9)
  const uint32_t denorm = as_bits(as_float(a) + as_float(141u << 23)) - (141u << 23);
  const uint32_t normal = (a + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  uint32_t r = a < (121u << 23) ? denorm : normal;
  r = a >= (1087u << 20) ? 0x7fu : r;
  return static_cast<uint8_t>(r | (sign >> 24));
}

void fp8_encode(const float* x, float scale, int64_t n, uint8_t* q) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i] / scale;
    v = v < -448.0f ? -448.0f : v;  // comparisons are false for nan: nan stays nan
    v = v > 448.0f ? 448.0f : v;
    q[i] = fp8_e4m3(v);
  }
}

void int8_encode(const float* x, float scale, int64_t n, int8_t* q) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i] / scale;
    v = v < -127.0f ? -127.0f : v;  // comparisons are false for nan
    v = v > 127.0f ? 127.0f : v;
    v = (v + 12582912.0f) - 12582912.0f;  // round half to even: 1.5 * 2^23 has unit spacing
    q[i] = static_cast<int8_t>(v == v ? static_cast<int32_t>(v) : 0);
  }
}

}  // namespace
