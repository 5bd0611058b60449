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
  GLM5_REQUIRE(d == DType::I32 || d == DType::I64, op, "slot_mapping", "dtype int32 or int64",
               "dtype code " + str(static_cast<int>(d)));
  GLM5_REQUIRE(tokens >= 0, op, "slot_mapping", "T >= 0", str(tokens));
  GLM5_REQUIRE(num_slots >= 0, op, "cache", "num_blocks * block_size >= 0", str(num_slots));
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

// Two paged views written by one call must not share a byte: either their address ranges are
// apart, or they interleave page by page with one page stride and disjoint spans within a page
// (vLLM's indexer pages: each block's FP8 rows, then its scales).
void require_disjoint_pages(const View& a, int64_t a_stride, const View& b, int64_t b_stride, const char* op,
                            const char* arg) {
  const int64_t ae = dtype_bytes(a.dtype), be = dtype_bytes(b.dtype);
  int64_t a_block = ae, b_block = be;
  for (int d = 1; d < a.ndim; ++d) a_block *= a.size[d];
  for (int d = 1; d < b.ndim; ++d) b_block *= b.size[d];
  if (a.numel() == 0 || b.numel() == 0) return;
  const int64_t a_lo = reinterpret_cast<int64_t>(a.data), b_lo = reinterpret_cast<int64_t>(b.data);
  const int64_t a_hi = a_lo + (a.size[0] - 1) * a_stride * ae + a_block;
  const int64_t b_hi = b_lo + (b.size[0] - 1) * b_stride * be + b_block;
  if (a_hi <= b_lo || b_hi <= a_lo) return;
  const int64_t page = a_stride * ae;
  bool disjoint = a.size[0] == b.size[0] && page == b_stride * be && page > 0;
  if (disjoint) {
    const int64_t offset = (((b_lo - a_lo) % page) + page) % page;  // b's span within a page of a
    disjoint = offset >= a_block && offset + b_block <= page;
  }
  GLM5_REQUIRE(disjoint, op, arg, "memory apart from the other cache argument's (or interleaved with it page by page)",
               "an overlapping view");
}

}  // namespace

void kv_cache_write(const View& cache, const RowsIn& values, const DenseIn& slot_mapping, int num_threads) {
  const char* op = "kv_cache_write";
  require_ndim(cache, 3, op, "cache");
  const int64_t block_stride = require_paged(cache, op, "cache");
  const int64_t es = dtype_bytes(cache.dtype), num_slots = cache.size[0] * cache.size[1], dim = cache.size[2];
  const int64_t block_size = cache.size[1];
  GLM5_REQUIRE(es > 0, op, "cache", "a dtype of the glm5::DType enum", dtype_name(cache.dtype));
  require_ndim(values, 2, op, "values");
  const Rows v = rows_of(values, op, "values");
  GLM5_REQUIRE(v.cols == dim, op, "values", "rows of D = " + str(dim) + " (that of 'cache')", str(v.cols));
  require_dtype_of(values, cache, op, "values", "cache");
  GLM5_REQUIRE(v.row_stride >= 0, op, "values", "a row stride >= 0", str(v.row_stride));
  const int64_t tokens = v.rows, row_bytes = dim * es, values_row_stride_bytes = v.row_stride * es;
  require_dense(slot_mapping, {tokens}, op, "slot_mapping");
  const void* slots = slot_mapping.data;
  const DType slot_dtype = slot_mapping.dtype;
  check_slots(op, slots, slot_dtype, tokens, num_slots);
  if (tokens == 0 || row_bytes == 0) return;
  const char* vb = static_cast<const char*>(v.data);
  char* cb = static_cast<char*>(cache.data);
  const int nt = threads_for(tokens * row_bytes / 2, num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slot_at(slots, slot_dtype, t);
    if (s >= 0)
      std::memcpy(cb + ((s / block_size) * block_stride + (s % block_size) * dim) * es,
                  vb + t * values_row_stride_bytes, static_cast<size_t>(row_bytes));
  }
}

void indexer_k_cache_write(const RowsIn& k, const View& k_cache_view, const View& k_scale_view,
                           const DenseIn& slot_mapping, bool ue8m0, int num_threads) {
  const char* op = "indexer_k_cache_write";
  require_ndim(k, 2, op, "k");
  const Rows kr = rows_of(k, op, "k");
  const int64_t tokens = kr.rows, dim = kr.cols, k_row_stride = kr.row_stride;
  GLM5_REQUIRE(dim >= 1, op, "k", "shape [T, D] with D >= 1", "D = " + str(dim));
  GLM5_REQUIRE(k_row_stride >= 0, op, "k", "a row stride >= 0", str(k_row_stride));
  require_float(k.dtype, op, "k");
  require_dtype(k_cache_view, DType::F8E4M3, op, "k_cache");
  require_ndim(k_cache_view, 3, op, "k_cache");
  const int64_t blocks = k_cache_view.size[0], block_size = k_cache_view.size[1];
  GLM5_REQUIRE(k_cache_view.size[2] == dim, op, "k_cache", "shape [" + str(blocks) + ", " + str(block_size) + ", " +
               str(dim) + "]", shape_str(k_cache_view));
  const int64_t cache_block_stride = require_paged(k_cache_view, op, "k_cache");
  require_dtype(k_scale_view, DType::F32, op, "k_scale");
  require_ndim(k_scale_view, 2, op, "k_scale");
  GLM5_REQUIRE(k_scale_view.size[0] == blocks && k_scale_view.size[1] == block_size, op, "k_scale",
               "shape [" + str(blocks) + ", " + str(block_size) + "]", shape_str(k_scale_view));
  const int64_t scale_block_stride = require_paged(k_scale_view, op, "k_scale");
  require_disjoint_pages(k_cache_view, cache_block_stride, k_scale_view, scale_block_stride, op, "k_scale");
  require_dense(slot_mapping, {tokens}, op, "slot_mapping");
  const DType k_dtype = k.dtype, slot_dtype = slot_mapping.dtype;
  const void* slots = slot_mapping.data;
  uint8_t* k_cache = static_cast<uint8_t*>(k_cache_view.data);
  float* k_scale = static_cast<float*>(k_scale_view.data);
  check_slots(op, slots, slot_dtype, tokens, blocks * block_size);
  if (tokens == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(k_dtype);
  const char* kb = static_cast<const char*>(kr.data);
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
      const int64_t block = s / block_size, offset = s % block_size;
      K.fp8_encode(buf.data(), scale, dim, k_cache + block * cache_block_stride + offset * dim);
      k_scale[block * scale_block_stride + offset] = scale;
    }
  }
}

int64_t kv_cache_gather_rows(const View& cache, const View& block_table, const DenseIn& context_lens_view) {
  const char* op = "kv_cache_gather";
  require_ndim(cache, 3, op, "cache");
  const int64_t block_size = cache.size[1];
  GLM5_REQUIRE(block_size >= 0, op, "cache", "block_size >= 0", str(block_size));
  require_dtype(block_table, DType::I32, op, "block_table");
  require_ndim(block_table, 2, op, "block_table");
  const int64_t batch = block_table.size[0], max_blocks = block_table.size[1];
  GLM5_REQUIRE(batch >= 0, op, "block_table", "B >= 0", str(batch));
  GLM5_REQUIRE(max_blocks >= 0, op, "block_table", "max_blocks >= 0", str(max_blocks));
  require_dtype(context_lens_view, DType::I32, op, "context_lens");
  require_dense(context_lens_view, {batch}, op, "context_lens");
  const int32_t* context_lens = static_cast<const int32_t*>(context_lens_view.data);
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

void kv_cache_gather(const View& out, const DenseIn& cache, const RowsIn& block_table_view,
                     const DenseIn& context_lens_view, int num_threads) {
  const char* op = "kv_cache_gather";
  require_ndim(cache, 3, op, "cache");
  require_contiguous(cache, op, "cache");
  const int64_t num_blocks = cache.size[0], block_size = cache.size[1], dim = cache.size[2];
  const int64_t es = dtype_bytes(cache.dtype), row_bytes = dim * es;
  GLM5_REQUIRE(es > 0, op, "cache", "a dtype of the glm5::DType enum", dtype_name(cache.dtype));
  const int64_t total = kv_cache_gather_rows(cache, block_table_view, context_lens_view);
  const Rows bt = rows_of(block_table_view, op, "block_table");
  GLM5_REQUIRE(bt.row_stride >= 0, op, "block_table", "a row stride >= 0", str(bt.row_stride));
  require_ndim(out, 2, op, "out");
  GLM5_REQUIRE(out.size[0] == total, op, "out", "sum(context_lens) = " + str(total) + " rows", str(out.size[0]));
  require_dense(out, {total, dim}, op, "out");
  require_dtype_of(out, cache, op, "out", "cache");
  const int64_t batch = bt.rows, block_table_row_stride = bt.row_stride;
  const int32_t* block_table = static_cast<const int32_t*>(bt.data);
  const int32_t* context_lens = static_cast<const int32_t*>(context_lens_view.data);
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
  const char* cb = static_cast<const char*>(cache.data);
  char* ob = static_cast<char*>(out.data);
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
