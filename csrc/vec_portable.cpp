// The portable tier of vec.h (every CPU), and the run-time choice of tier.
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "vec.h"

#define GLM5_VEC_TIER 0
#include "vec_impl.h"

namespace glm5::vec {

const Kernels& portable_kernels() {
  static const Kernels k{kPortable, load_row, store_row, accumulate_row, weighted_sum, sum_squares, abs_max,
                         scale_mul,  sigmoid, silu_mul, fwht,      rope,           fp8_encode, int8_encode};
  return k;
}

namespace {

std::atomic<int> isa_limit{kAvx512};

const Kernels* tier(int level) {
#if GLM5_VEC_X86
  if (level >= kAvx512) {
    if (const Kernels* k = avx512_kernels()) return k;
  }
  if (level >= kAvx2) {
    if (const Kernels* k = avx2_kernels()) return k;
  }
#else
  (void)level;
#endif
  return &portable_kernels();
}

}  // namespace

const Kernels& kernels() { return *tier(isa_limit.load(std::memory_order_relaxed)); }
int isa() { return kernels().isa; }
int max_isa() { return tier(kAvx512)->isa; }
int set_isa_limit(int limit) { return isa_limit.exchange(limit < 0 ? 0 : limit); }

}  // namespace glm5::vec
