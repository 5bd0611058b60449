// Data-dependent input checks of the ops (index ranges, repeated slots, block tables), on
// host memory. glm5_hal's dispatch runs them on CPU tensors before an implementation that
// does not validate values itself (the reference, vendor adapters on emulators): a scan here
// costs well under a microsecond where the same check in torch ops costs tens.
// Each returns the position of the first violation (or -1), never throws and reads only the
// elements it is given; the caller words the error.
#pragma once

#include <cstdint>
#include <utility>

#include "core.h"

namespace glm5 {

// Flat index of the first element of `data` (int32 or int64, n elements) outside [lo, hi)
// that is not `allowed` (when has_allowed); -1 if there is none.
int64_t first_outside(const void* data, int64_t n, DType dtype, int64_t lo, int64_t hi, bool has_allowed,
                      int64_t allowed);

// The smallest value >= 0 that occurs more than once in `data` (int32 or int64); -1 if none.
// Negative values (padding) are skipped.
int64_t smallest_repeat(const void* data, int64_t n, DType dtype);

// Sum of `data` (int32 or int64) as int64.
int64_t sum_of(const void* data, int64_t n, DType dtype);

// The first (b, j) whose block is in use -- j < ceil(context_lens[b] / block_size) -- but whose
// id block_table[b * row_stride + j] is outside [0, num_blocks); (-1, -1) if none. context_lens
// must already be in [0, max_blocks * block_size].
std::pair<int64_t, int64_t> first_bad_block(const int32_t* block_table, int64_t batch, int64_t max_blocks,
                                            int64_t row_stride, const int32_t* context_lens, int64_t block_size,
                                            int64_t num_blocks);

// Indexer ranges 0 <= start[t] <= end[t] <= num_keys: (1, t) for the first end outside
// [0, num_keys], else (2, t) for the first start < 0 or > end[t], else (0, -1).
std::pair<int, int64_t> first_bad_range(const int32_t* start, const int32_t* end, int64_t n, int64_t num_keys);

}  // namespace glm5
