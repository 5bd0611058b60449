#include "moe.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace glm5 {

namespace {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

void check_src(const char* op, const int32_t* src, int64_t rows, int64_t flat) {
  for (int64_t r = 0; r < rows; ++r) {
    if (src[r] < 0 || src[r] >= flat)
      throw InvalidInput(op, "src", "values in [0, " + str(flat) + ") (T * k)",
                         str(src[r]) + " at index " + str(r));
  }
}

}  // namespace

int64_t moe_permute_plan(int32_t* tokens_per_expert, int32_t* src, const int32_t* ids, int64_t tokens,
                         int64_t k, int64_t ids_row_stride, int64_t num_experts) {
  const char* op = "moe_permute";
  require(tokens >= 0, op, "ids", "T >= 0", str(tokens));
  require(k >= 1, op, "ids", "shape [T, k] with k >= 1", "k = " + str(k));
  require(ids_row_stride >= 0, op, "ids", "a row stride >= 0", str(ids_row_stride));
  require(tokens * k <= kMaxInt32, op, "ids", "T * k <= 2^31 - 1 (int32 flat indices)", str(tokens * k));
  require(num_experts >= 1 && num_experts <= kMaxInt32, op, "num_experts", "an int in [1, 2^31 - 1]",
          str(num_experts));
  // Counting sort by expert: one pass to count, one to place (stable, so ascending flat
  // index within an expert). Offsets in int64: counts of one expert can reach T * k.
  std::vector<int64_t> offset(static_cast<size_t>(num_experts) + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* row = ids + t * ids_row_stride;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = row[j];
      if (e >= 0 && e < num_experts) ++offset[e + 1];
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    tokens_per_expert[e] = static_cast<int32_t>(offset[e + 1]);
    offset[e + 1] += offset[e];
  }
  const int64_t rows = offset[num_experts];
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* row = ids + t * ids_row_stride;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = row[j];
      if (e >= 0 && e < num_experts) src[offset[e]++] = static_cast<int32_t>(t * k + j);
    }
  }
  return rows;
}

void moe_permute_gather(void* x_perm, const void* x, int64_t tokens, int64_t row_bytes,
                        int64_t x_row_stride_bytes, const int32_t* src, int64_t rows, int64_t k,
                        int num_threads) {
  const char* op = "moe_permute";
  require(tokens >= 0 && rows >= 0, op, "x", "T >= 0 and M >= 0", str(tokens) + ", " + str(rows));
  require(k >= 1, op, "ids", "k >= 1", str(k));
  require(row_bytes >= 0, op, "x", "a row size >= 0", str(row_bytes));
  require(x_row_stride_bytes >= 0, op, "x", "a row stride >= 0", str(x_row_stride_bytes));
  check_src(op, src, rows, tokens * k);
  if (rows == 0 || row_bytes == 0) return;
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(x_perm);
  advise_fresh_output(ob, rows * row_bytes);
  const int nt = threads_for(rows * row_bytes / 2, num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(ob + r * row_bytes, xb + (src[r] / k) * x_row_stride_bytes, static_cast<size_t>(row_bytes));
}

void moe_unpermute(void* out, const void* y, int64_t rows, int64_t dim, int64_t y_row_stride,
                   const int32_t* src, const float* weights, int64_t tokens, int64_t k, DType dtype,
                   int num_threads) {
  const char* op = "moe_unpermute";
  require(tokens >= 0 && rows >= 0, op, "y", "T >= 0 and M >= 0", str(tokens) + ", " + str(rows));
  require(k >= 1, op, "weights", "shape [T, k] with k >= 1", "k = " + str(k));
  require(dim >= 0, op, "y", "a row width >= 0", str(dim));
  require(y_row_stride >= 0, op, "y", "a row stride >= 0", str(y_row_stride));
  require(tokens * k <= kMaxInt32, op, "weights", "T * k <= 2^31 - 1 (int32 flat indices)", str(tokens * k));
  require_float(dtype, op, "y");
  check_src(op, src, rows, tokens * k);
  if (tokens == 0 || dim == 0) return;
  // Rows by slot t*k + j (counting sort, stable in row order): start[s]..start[s+1].
  const int64_t slots = tokens * k;
  std::vector<int32_t> start(static_cast<size_t>(slots) + 1, 0);
  std::vector<int32_t> order(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) ++start[src[r] + 1];
  for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
  {
    std::vector<int32_t> fill(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < rows; ++r) order[fill[src[r]]++] = static_cast<int32_t>(r);
  }
  bool one_row_per_slot = true;
  for (int64_t s = 0; s < slots && one_row_per_slot; ++s) one_row_per_slot = start[s + 1] - start[s] <= 1;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const char* yb = static_cast<const char*>(y);
  char* ob = static_cast<char*>(out);
  advise_fresh_output(ob, tokens * dim * es);
  const int nt = threads_for((rows + tokens) * dim, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> acc(static_cast<size_t>(dim)), slot_acc(static_cast<size_t>(dim));
    std::vector<const void*> row_ptrs(static_cast<size_t>(k));
    std::vector<float> row_w(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      if (one_row_per_slot) {
        int64_t n = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = t * k + j;
          if (start[s] == start[s + 1]) continue;
          row_ptrs[n] = yb + static_cast<int64_t>(order[start[s]]) * y_row_stride * es;
          row_w[n++] = weights[s];
        }
        K.weighted_sum(dtype, row_ptrs.data(), row_w.data(), n, dim, ob + t * dim * es);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = t * k + j;
        const int32_t first = start[s], last = start[s + 1];
        if (first == last) continue;
        const float w = weights[s];
        if (last - first == 1) {
          K.accumulate(dtype, yb + static_cast<int64_t>(order[first]) * y_row_stride * es, w, dim, acc.data());
          continue;
        }
        // Several rows in one slot: the weighted rows of the slot are summed first, then the
        // slot joins the token's sum (the reference's order: index_add per slot, then j).
        std::fill(slot_acc.begin(), slot_acc.end(), 0.f);
        for (int32_t i = first; i < last; ++i)
          K.accumulate(dtype, yb + static_cast<int64_t>(order[i]) * y_row_stride * es, w, dim, slot_acc.data());
        K.accumulate(DType::F32, slot_acc.data(), 1.0f, dim, acc.data());
      }
      K.store(dtype, acc.data(), dim, ob + t * dim * es);
    }
  }
}

}  // namespace glm5
