#include "kv.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant.h"
#include "vec.h"

namespace glm5 {

namespace {

inline int64_t slot_at(const void* slots, DType d, int64_t t) {
  return d == DType::I32 ? static_cast<int64_t>(static_cast<const int32_t*>(slots)[t])
                         : static_cast<const int64_t*>(slots)[t];
}

// Every slot in [-1, num_slots), no slot >= 0 twice; checked before anything is written.
void check_slots(const char* op, const void* slots, DType d, int64_t tokens, int64_t num_slots) {
  require(d == DType::I32 || d == DType::I64, op, "slot_mapping", "dtype int32 or int64",
          "dtype code " + str(static_cast<int>(d)));
  require(tokens >= 0, op, "slot_mapping", "T >= 0", str(tokens));
  require(num_slots >= 0, op, "cache", "num_blocks * block_size >= 0", str(num_slots));
  std::vector<int64_t> used;
  used.reserve(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slot_at(slots, d, t);
    if (s < -1 || s >= num_slots)
      throw InvalidInput(op, "slot_mapping", "values in [0, " + str(num_slots) + ") (or -1)",
                         str(s) + " at flat index " + str(t));
    if (s >= 0) used.push_back(s);
  }
  std::sort(used.begin(), used.end());
  const auto dup = std::adjacent_find(used.begin(), used.end());
  if (dup != used.end())
    throw InvalidInput(op, "slot_mapping", "distinct slots (-1 may repeat)", "slot " + str(*dup) + " more than once");
}

}  // namespace

void kv_cache_write(void* cache, int64_t num_slots, int64_t row_bytes, const void* values,
                    int64_t values_row_stride_bytes, int64_t tokens, const void* slots, DType slot_dtype,
                    int num_threads) {
  const char* op = "kv_cache_write";
  require(row_bytes >= 0, op, "values", "a row size >= 0", str(row_bytes));
  require(values_row_stride_bytes >= 0, op, "values", "a row stride >= 0", str(values_row_stride_bytes));
  check_slots(op, slots, slot_dtype, tokens, num_slots);
  if (tokens == 0 || row_bytes == 0) return;
  const char* vb = static_cast<const char*>(values);
  char* cb = static_cast<char*>(cache);
  const int nt = threads_for(tokens * row_bytes / 2, num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slot_at(slots, slot_dtype, t);
    if (s >= 0) std::memcpy(cb + s * row_bytes, vb + t * values_row_stride_bytes, static_cast<size_t>(row_bytes));
  }
}

void indexer_k_cache_write(const void* k, int64_t tokens, int64_t dim, int64_t k_row_stride, DType k_dtype,
                           uint8_t* k_cache, float* k_scale, int64_t num_slots, const void* slots,
                           DType slot_dtype, bool ue8m0, int num_threads) {
  const char* op = "indexer_k_cache_write";
  require(dim >= 1, op, "k", "shape [T, D] with D >= 1", "D = " + str(dim));
  require(k_row_stride >= 0, op, "k", "a row stride >= 0", str(k_row_stride));
  require_float(k_dtype, op, "k");
  check_slots(op, slots, slot_dtype, tokens, num_slots);
  if (tokens == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(k_dtype);
  const char* kb = static_cast<const char*>(k);
  const int nt = threads_for(tokens * dim * 4, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(dim));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t s = slot_at(slots, slot_dtype, t);
      if (s < 0) continue;
      K.load(k_dtype, kb + t * k_row_stride * es, dim, buf.data());
      const float scale = fp8_block_scale(K.abs_max(buf.data(), dim), ue8m0);
      K.fp8_encode(buf.data(), scale, dim, k_cache + s * dim);
      k_scale[s] = scale;
    }
  }
}

int64_t kv_cache_gather_rows(const int32_t* context_lens, int64_t batch, int64_t max_blocks, int64_t block_size) {
  const char* op = "kv_cache_gather";
  require(batch >= 0, op, "block_table", "B >= 0", str(batch));
  require(max_blocks >= 0, op, "block_table", "max_blocks >= 0", str(max_blocks));
  require(block_size >= 0, op, "cache", "block_size >= 0", str(block_size));
  const int64_t capacity = max_blocks * block_size;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (context_lens[b] < 0 || context_lens[b] > capacity)
      throw InvalidInput(op, "context_lens", "values in [0, " + str(capacity + 1) + ")",
                         str(context_lens[b]) + " at flat index " + str(b));
    total += context_lens[b];
  }
  return total;
}

void kv_cache_gather(void* out, int64_t out_rows, const void* cache, int64_t num_blocks, int64_t block_size,
                     int64_t row_bytes, const int32_t* block_table, int64_t batch, int64_t max_blocks,
                     int64_t block_table_row_stride, const int32_t* context_lens, int num_threads) {
  const char* op = "kv_cache_gather";
  require(num_blocks >= 0, op, "cache", "num_blocks >= 0", str(num_blocks));
  require(row_bytes >= 0, op, "cache", "a row size >= 0", str(row_bytes));
  require(block_table_row_stride >= 0, op, "block_table", "a row stride >= 0", str(block_table_row_stride));
  const int64_t total = kv_cache_gather_rows(context_lens, batch, max_blocks, block_size);
  require(out_rows == total, op, "out", "sum(context_lens) = " + str(total) + " rows", str(out_rows));
  // One chunk per block in use: up to block_size contiguous cache rows to contiguous output rows.
  struct Chunk { int64_t out_row, block, rows; };
  std::vector<Chunk> chunks;
  int64_t row = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = context_lens[b];
    const int32_t* table = block_table + b * block_table_row_stride;
    for (int64_t j = 0; j * block_size < len; ++j) {
      const int32_t blk = table[j];
      if (blk < 0 || blk >= num_blocks)
        throw InvalidInput(op, "block_table", "block ids in [0, " + str(num_blocks) + ") for the ceil(context_lens / " +
                                                  str(block_size) + ") blocks in use",
                           str(blk) + " at [" + str(b) + ", " + str(j) + "] (context_lens[" + str(b) + "] = " +
                               str(len) + ")");
      const int64_t n = std::min(block_size, len - j * block_size);
      chunks.push_back({row, blk, n});
      row += n;
    }
  }
  if (total == 0 || row_bytes == 0) return;
  const char* cb = static_cast<const char*>(cache);
  char* ob = static_cast<char*>(out);
  advise_fresh_output(ob, total * row_bytes);
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  const int nt = threads_for(total * row_bytes / 2, num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    const Chunk& ch = chunks[c];
    std::memcpy(ob + ch.out_row * row_bytes, cb + ch.block * block_size * row_bytes,
                static_cast<size_t>(ch.rows * row_bytes));
  }
}

}  // namespace glm5
