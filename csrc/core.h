// Shared utilities of the native kernels: dtype codes and conversions, input errors,
// threading. Plain C++17, no libtorch: kernels take raw pointers, sizes and strides.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace glm5 {

// Element types crossing the Python boundary. Values are part of the binding ABI.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, F8E4M3 = 3, I32 = 4, I64 = 5, I8 = 6 };

// Raised for invalid inputs (out-of-range index, bad size). The bindings turn it into
// glm5_hal.InvalidInputError(op, arg, expected, actual). Thrown before any write.
struct InvalidInput : std::invalid_argument {
  std::string op, arg, expected, actual;
  InvalidInput(std::string op_, std::string arg_, std::string expected_, std::string actual_)
      : std::invalid_argument(op_ + ": argument '" + arg_ + "': expected " + expected_ + ", got " + actual_),
        op(std::move(op_)), arg(std::move(arg_)), expected(std::move(expected_)), actual(std::move(actual_)) {}
};

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, with overflow to inf and gradual underflow.
inline uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;              // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;             // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                   // below the smallest normal
    if (abs < 0x33000000u) return sign;                      // rounds to zero
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;                          // 14..24 -> result mantissa
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t r = abs - 0x38000000u;                            // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

template <DType D> struct Storage;
template <> struct Storage<DType::F32> { using type = float; };
template <> struct Storage<DType::F16> { using type = uint16_t; };
template <> struct Storage<DType::BF16> { using type = uint16_t; };

template <DType D> inline float load(const typename Storage<D>::type* p, int64_t i);
template <> inline float load<DType::F32>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<DType::F16>(const uint16_t* p, int64_t i) { return f16_to_f32(p[i]); }
template <> inline float load<DType::BF16>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

template <DType D> inline void store(typename Storage<D>::type* p, int64_t i, float v);
template <> inline void store<DType::F32>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<DType::F16>(uint16_t* p, int64_t i, float v) { p[i] = f32_to_f16(v); }
template <> inline void store<DType::BF16>(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

template <DType D> using DTypeTag = std::integral_constant<DType, D>;

// Calls f(DTypeTag<D>{}) for the runtime dtype code; InvalidInput for a non-float code.
// In the callee: `constexpr DType D = decltype(tag)::value;`
template <typename F>
inline void dispatch_float(DType d, const char* op, const char* arg, F&& f) {
  switch (d) {
    case DType::F32: f(DTypeTag<DType::F32>{}); return;
    case DType::F16: f(DTypeTag<DType::F16>{}); return;
    case DType::BF16: f(DTypeTag<DType::BF16>{}); return;
    default: throw InvalidInput(op, arg, "dtype float32, float16 or bfloat16", "dtype code " + std::to_string(static_cast<int>(d)));
  }
}

// Throws InvalidInput(op, arg, expected, actual) unless `ok`. A macro so that the messages
// (string concatenations) are built only on failure: these checks run on every call.
#define GLM5_REQUIRE(ok, op, arg, expected, actual)                          \
  do {                                                                       \
    if (!(ok)) throw ::glm5::InvalidInput((op), (arg), (expected), (actual)); \
  } while (false)

inline int clamp_threads(int n) { return n < 1 ? 1 : n; }

inline bool is_float(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16; }

// "float32", ..., or "dtype code N" for a code outside the enum.
inline std::string dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F8E4M3: return "float8_e4m3fn";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::I8: return "int8";
  }
  return "dtype code " + std::to_string(static_cast<int>(d));
}

// Bytes per element; 0 for an unknown code.
inline int64_t dtype_bytes(DType d) {
  switch (d) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F8E4M3: case DType::I8: return 1;
    case DType::I64: return 8;
  }
  return 0;
}

inline std::string str(int64_t v) { return std::to_string(v); }

inline void require_float(DType d, const char* op, const char* arg) {
  GLM5_REQUIRE(is_float(d), op, arg, "dtype float32, float16 or bfloat16", "dtype code " + str(static_cast<int>(d)));
}

// Threads for `work` elements of cheap per-element work: one below ~64K elements, where
// waking a team costs more than it saves.
inline int threads_for(int64_t work, int num_threads) {
  return work < 65536 ? 1 : clamp_threads(num_threads);
}

}  // namespace glm5
