#include "value_checks.h"

#include <algorithm>
#include <vector>

namespace glm5 {
namespace {

template <typename T, typename F>
int64_t scan(const void* data, int64_t n, F&& bad) {
  const T* v = static_cast<const T*>(data);
  for (int64_t i = 0; i < n; ++i)
    if (bad(static_cast<int64_t>(v[i]))) return i;
  return -1;
}

template <typename F>
int64_t scan_int(const void* data, int64_t n, DType dtype, F&& bad) {
  if (dtype == DType::I64) return scan<int64_t>(data, n, bad);
  return scan<int32_t>(data, n, bad);
}

}  // namespace

int64_t first_outside(const void* data, int64_t n, DType dtype, int64_t lo, int64_t hi, bool has_allowed,
                      int64_t allowed) {
  return scan_int(data, n, dtype, [&](int64_t x) { return (x < lo || x >= hi) && !(has_allowed && x == allowed); });
}

int64_t smallest_repeat(const void* data, int64_t n, DType dtype) {
  std::vector<int64_t> used;
  used.reserve(static_cast<size_t>(n));
  scan_int(data, n, dtype, [&](int64_t x) {
    if (x >= 0) used.push_back(x);
    return false;
  });
  std::sort(used.begin(), used.end());
  auto it = std::adjacent_find(used.begin(), used.end());
  return it == used.end() ? -1 : *it;
}

int64_t sum_of(const void* data, int64_t n, DType dtype) {
  int64_t total = 0;
  scan_int(data, n, dtype, [&](int64_t x) {
    total += x;
    return false;
  });
  return total;
}

std::pair<int64_t, int64_t> first_bad_block(const int32_t* block_table, int64_t batch, int64_t max_blocks,
                                            int64_t row_stride, const int32_t* context_lens, int64_t block_size,
                                            int64_t num_blocks) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = std::min<int64_t>(max_blocks, (int64_t{context_lens[b]} + block_size - 1) / block_size);
    const int32_t* row = block_table + b * row_stride;
    for (int64_t j = 0; j < used; ++j)
      if (row[j] < 0 || row[j] >= num_blocks) return {b, j};
  }
  return {-1, -1};
}

std::pair<int, int64_t> first_bad_range(const int32_t* start, const int32_t* end, int64_t n, int64_t num_keys) {
  for (int64_t t = 0; t < n; ++t)
    if (end[t] < 0 || end[t] > num_keys) return {1, t};
  for (int64_t t = 0; t < n; ++t)
    if (start[t] < 0 || start[t] > end[t]) return {2, t};
  return {0, -1};
}

}  // namespace glm5
