// The little harness the native test drivers share: CHECK (counts, prints and keeps going,
// so one run reports every failure), a seeded random source, and the float dtypes by name.
#pragma once

#include <cstdio>
#include <random>

#include "core.h"

namespace glm5_test {

inline int g_failures = 0;
inline int g_checks = 0;
inline std::mt19937 rng(1234);

inline float randn() {
  static std::normal_distribution<float> n(0.0f, 1.0f);
  return n(rng);
}

inline int randint(int lo, int hi) {  // [lo, hi]
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

// The float dtypes the kernels take, and their short names in failure messages.
inline const glm5::DType kFloats[] = {glm5::DType::F32, glm5::DType::F16, glm5::DType::BF16};
inline const char* name(glm5::DType d) {
  return d == glm5::DType::F32 ? "f32" : d == glm5::DType::F16 ? "f16" : "bf16";
}

}  // namespace glm5_test

#define CHECK(cond, ...)                                          \
  do {                                                            \
    ++glm5_test::g_checks;                                        \
    if (!(cond)) {                                                \
      ++glm5_test::g_failures;                                    \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
    }                                                             \
  } while (0)
