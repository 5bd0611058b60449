// Top-k selection for the DSA indexer: a radix select on order-preserving float bits, linear
// in n (two passes over the row, then passes over the boundary bucket only).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace glm5::dsa {

// Larger float -> larger key; every nan ranks above +inf (as torch.topk treats nan as largest).
inline uint32_t order_key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct SelectScratch {
  std::vector<uint32_t> keys[2];
  std::vector<int32_t> index[2];
  void reserve(size_t n) {
    for (int i = 0; i < 2; ++i) {
      keys[i].reserve(n);
      index[i].reserve(n);
    }
  }
};

// Writes the indices (into vals) of min(k, n) largest values of vals[0, n) to sel, in no
// particular order, and returns how many. Ties at the boundary are broken by lower index.
// n < 2^31. Allocates only if `scratch` holds less than the boundary bucket.
int64_t select_topk(const float* vals, int64_t n, int64_t k, int32_t* sel, SelectScratch& scratch);

}  // namespace glm5::dsa
