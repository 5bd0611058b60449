// Element access for the CUDA-dialect kernels: float32, float16, bfloat16 and FP8 E4M3 as
// raw bits, converted to and from float32 in code rather than through a vendor's half /
// bfloat16 types (cuda_fp16.h, hip_fp16.h and MUSA's headers differ; bits do not).
// Conversions to 16 bits round to nearest-even, like torch's .to(dtype).
//
// With GLM5_HAL_GPU_HOST_TEST defined this header compiles as plain C++ for the host, so
// tests/test_cuda_dialect.py checks every conversion against torch on the CPU.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(GLM5_HAL_GPU_HOST_TEST)
#include <string.h>
#define GLM5_HAL_DEVICE inline
inline uint32_t glm5_hal_float_as_uint(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
inline float glm5_hal_uint_as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
#else
#define GLM5_HAL_DEVICE __device__ __forceinline__
#define glm5_hal_float_as_uint __float_as_uint
#define glm5_hal_uint_as_float __uint_as_float
#endif

namespace glm5_hal_gpu {

GLM5_HAL_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) {  // inf / nan keep their payload
    return glm5_hal_uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  }
  return glm5_hal_uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

GLM5_HAL_DEVICE uint16_t float_to_half_bits(float f) {
  const uint32_t bits = glm5_hal_float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;    // nan
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;   // >= 65520 rounds to inf
  if (magnitude < 0x38800000u) {                         // below 2^-14: half subnormal
    // value * 2^24 is exact; rintf rounds half to even
    const float scaled = glm5_hal_uint_as_float(magnitude) * 16777216.0f;
    return sign | static_cast<uint16_t>(rintf(scaled));
  }
  // rebias 127 -> 15 and round the 13 dropped mantissa bits to nearest-even
  const uint32_t rounded = (magnitude - 0x38000000u) + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

GLM5_HAL_DEVICE float bf16_bits_to_float(uint16_t b) {
  return glm5_hal_uint_as_float(static_cast<uint32_t>(b) << 16);
}

GLM5_HAL_DEVICE uint16_t float_to_bf16_bits(float f) {
  const uint32_t bits = glm5_hal_float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet nan, sign kept
  }
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// float8_e4m3fn: bias 7, no infinities, S.1111.111 is nan.
GLM5_HAL_DEVICE float fp8_e4m3_bits_to_float(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exponent = (v >> 3) & 0xfu;
  const uint32_t mantissa = v & 0x7u;
  if (exponent == 15 && mantissa == 7) return glm5_hal_uint_as_float(sign | 0x7fc00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // * 2^-9
    return sign ? -magnitude : magnitude;
  }
  return glm5_hal_uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// An unsigned key whose order is the float order (-inf < ... < -0 < +0 < ... < +inf), for
// radix selection.
GLM5_HAL_DEVICE uint32_t ordered_key(float f) {
  const uint32_t bits = glm5_hal_float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Element types: Storage is what one element occupies in memory.
struct F32 {
  typedef float Storage;
  static GLM5_HAL_DEVICE float load(const Storage* p, int64_t i) { return p[i]; }
  static GLM5_HAL_DEVICE void store(Storage* p, int64_t i, float v) { p[i] = v; }
};

struct F16 {
  typedef uint16_t Storage;
  static GLM5_HAL_DEVICE float load(const Storage* p, int64_t i) { return half_bits_to_float(p[i]); }
  static GLM5_HAL_DEVICE void store(Storage* p, int64_t i, float v) { p[i] = float_to_half_bits(v); }
};

struct BF16 {
  typedef uint16_t Storage;
  static GLM5_HAL_DEVICE float load(const Storage* p, int64_t i) { return bf16_bits_to_float(p[i]); }
  static GLM5_HAL_DEVICE void store(Storage* p, int64_t i, float v) { p[i] = float_to_bf16_bits(v); }
};

struct Fp8E4M3 {  // read-only: the kernels never produce FP8
  typedef uint8_t Storage;
  static GLM5_HAL_DEVICE float load(const Storage* p, int64_t i) { return fp8_e4m3_bits_to_float(p[i]); }
};

}  // namespace glm5_hal_gpu
