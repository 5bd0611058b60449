// Lightning-indexer top-k (docs/ops/dsa.md): indexer_topk over flat keys with per-token ranges,
// and indexer_topk_paged over a paged key cache with N query tokens per sequence.
//
// Two kernels per call:
//  1. logits: one block per (query row, chunk of key positions); the row's q (all heads)
//     and weights sit in shared memory; each thread scores one key position:
//     sum_h w[h] * relu(q[h] . k[s]), written to a float32 workspace row.
//  2. select: one block per query row. A row with at most topk keys takes them all
//     (-1 after). Otherwise a 4-pass radix select over the order-preserving 32-bit keys of
//     the logits finds the exact k-th largest value T; keys above T are taken, then keys
//     equal to T until topk are taken. Slots are claimed with shared-memory atomics, so
//     the order among the selected positions is unspecified (the contract allows it).
#include "gpu_runtime.h"
#include "numeric.cuh"

namespace glm5_hal_gpu {
namespace {

constexpr int kLogitThreads = 128;
constexpr int kSelectThreads = 256;
constexpr int kRadixBins = 256;

// Key range of query row r: [lo, hi).
struct FlatRange {
  const int32_t* k_start;
  const int32_t* k_end;
  __device__ __forceinline__ void of(int64_t r, int64_t* lo, int64_t* hi) const {
    *lo = k_start[r];
    *hi = k_end[r];
  }
};

struct PagedRange {
  const int32_t* context_lens;
  int64_t queries_per_seq;
  __device__ __forceinline__ void of(int64_t r, int64_t* lo, int64_t* hi) const {
    const int64_t sequence = r / queries_per_seq;
    const int64_t i = r % queries_per_seq;
    *lo = 0;
    const int64_t end = static_cast<int64_t>(context_lens[sequence]) - queries_per_seq + i + 1;
    *hi = end > 0 ? end : 0;
  }
};

// Physical key row of position p, or -1 when it cannot be read safely.
struct FlatRows {
  int64_t num_keys;
  __device__ __forceinline__ int64_t of(int64_t /*r*/, int64_t p) const {
    return p >= 0 && p < num_keys ? p : -1;
  }
};

struct PagedRows {
  const int32_t* block_table;
  int64_t queries_per_seq, num_blocks, block_size, max_blocks;
  __device__ __forceinline__ int64_t of(int64_t r, int64_t p) const {
    const int64_t block = p / block_size;
    if (p < 0 || block >= max_blocks) return -1;
    const int64_t id = block_table[(r / queries_per_seq) * max_blocks + block];
    if (id < 0 || id >= num_blocks) return -1;
    return id * block_size + p % block_size;
  }
};

template <class QElem, class KElem, class Range, class Rows>
__global__ void __launch_bounds__(kLogitThreads)
    indexer_logits_kernel(const typename QElem::Storage* __restrict__ q,
                          const typename KElem::Storage* __restrict__ keys, const float* __restrict__ key_scale,
                          const float* __restrict__ weights, Range range, Rows rows, float* __restrict__ workspace,
                          int64_t workspace_cols, int64_t heads, int64_t dim) {
  extern __shared__ float shared[];
  float* q_row = shared;               // heads * dim
  float* w_row = shared + heads * dim;  // heads

  const int64_t r = blockIdx.x;
  const typename QElem::Storage* q_ptr = q + r * heads * dim;
  for (int64_t e = threadIdx.x; e < heads * dim; e += kLogitThreads) q_row[e] = QElem::load(q_ptr, e);
  for (int64_t h = threadIdx.x; h < heads; h += kLogitThreads) w_row[h] = weights[r * heads + h];
  __syncthreads();

  int64_t lo, hi;
  range.of(r, &lo, &hi);
  const int64_t column = static_cast<int64_t>(blockIdx.y) * kLogitThreads + threadIdx.x;
  const int64_t p = lo + column;
  if (p >= hi || column >= workspace_cols) return;
  const int64_t row = rows.of(r, p);
  float logit = -INFINITY;  // unreadable key rows never win a selection among readable ones
  if (row >= 0) {
    const typename KElem::Storage* key = keys + row * dim;
    const float scale = key_scale != nullptr ? key_scale[row] : 1.f;
    logit = 0.f;
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q_row + h * dim;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qh[d] * KElem::load(key, d);
      logit += w_row[h] * fmaxf(dot * scale, 0.f);
    }
  }
  workspace[r * workspace_cols + column] = logit;
}

template <class Range>
__global__ void __launch_bounds__(kSelectThreads)
    indexer_select_kernel(const float* __restrict__ workspace, int64_t workspace_cols, Range range,
                          int32_t* __restrict__ out, int64_t topk) {
  __shared__ int histogram[kRadixBins];
  __shared__ uint32_t shared_prefix, shared_mask;
  __shared__ int64_t shared_remaining;
  __shared__ int taken_above, taken_equal;

  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  int64_t lo, hi;
  range.of(r, &lo, &hi);
  int64_t n = hi > lo ? hi - lo : 0;
  if (n > workspace_cols) n = workspace_cols;  // the Python side sizes the workspace exactly
  int32_t* out_row = out + r * topk;

  if (n <= topk) {
    for (int64_t j = tid; j < topk; j += kSelectThreads) out_row[j] = j < n ? static_cast<int32_t>(lo + j) : -1;
    return;
  }

  const float* logits = workspace + r * workspace_cols;
  if (tid == 0) {
    shared_prefix = 0;
    shared_mask = 0;
    shared_remaining = topk;
  }
  __syncthreads();
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < kRadixBins; b += kSelectThreads) histogram[b] = 0;
    __syncthreads();
    const uint32_t prefix = shared_prefix;
    const uint32_t mask = shared_mask;
    for (int64_t j = tid; j < n; j += kSelectThreads) {
      const uint32_t key = ordered_key(logits[j]);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xffu], 1);
    }
    __syncthreads();
    if (tid == 0) {
      // the bin holding the remaining-th largest key among those matching the prefix
      const int64_t remaining = shared_remaining;
      int64_t above = 0;
      for (int b = kRadixBins - 1; b >= 0; --b) {
        if (above + histogram[b] >= remaining) {
          shared_remaining = remaining - above;
          shared_prefix = prefix | (static_cast<uint32_t>(b) << shift);
          shared_mask = mask | (0xffu << shift);
          break;
        }
        above += histogram[b];
      }
      taken_above = 0;
      taken_equal = 0;
    }
    __syncthreads();
  }

  const uint32_t threshold = shared_prefix;
  const int64_t equal_wanted = shared_remaining;  // >= 1: keys equal to the threshold to take
  const int64_t above_count = topk - equal_wanted;
  for (int64_t j = tid; j < n; j += kSelectThreads) {
    const uint32_t key = ordered_key(logits[j]);
    if (key > threshold) {
      const int slot = atomicAdd(&taken_above, 1);
      out_row[slot] = static_cast<int32_t>(lo + j);
    } else if (key == threshold) {
      const int rank = atomicAdd(&taken_equal, 1);
      if (rank < equal_wanted) out_row[above_count + rank] = static_cast<int32_t>(lo + j);
    }
  }
}

template <class QElem, class KElem, class Range, class Rows>
void launch_logits(int64_t rows_count, int64_t workspace_cols, size_t shared_bytes, cudaStream_t stream,
                   const void* q, const void* keys, const float* key_scale, const float* weights, Range range,
                   Rows rows, float* workspace, int64_t heads, int64_t dim) {
  const dim3 grid(static_cast<unsigned>(rows_count),
                  static_cast<unsigned>((workspace_cols + kLogitThreads - 1) / kLogitThreads));
  indexer_logits_kernel<QElem, KElem, Range, Rows><<<grid, kLogitThreads, shared_bytes, stream>>>(
      static_cast<const typename QElem::Storage*>(q), static_cast<const typename KElem::Storage*>(keys),
      key_scale, weights, range, rows, workspace, workspace_cols, heads, dim);
}

template <class QElem, class Range, class Rows>
bool dispatch_keys(int k_dtype, int64_t rows_count, int64_t workspace_cols, size_t shared_bytes,
                   cudaStream_t stream, const void* q, const void* keys, const float* key_scale,
                   const float* weights, Range range, Rows rows, float* workspace, int64_t heads, int64_t dim) {
  switch (k_dtype) {
    case GLM5_HAL_F32:
      launch_logits<QElem, F32>(rows_count, workspace_cols, shared_bytes, stream, q, keys, nullptr, weights,
                                range, rows, workspace, heads, dim);
      return true;
    case GLM5_HAL_F16:
      launch_logits<QElem, F16>(rows_count, workspace_cols, shared_bytes, stream, q, keys, nullptr, weights,
                                range, rows, workspace, heads, dim);
      return true;
    case GLM5_HAL_BF16:
      launch_logits<QElem, BF16>(rows_count, workspace_cols, shared_bytes, stream, q, keys, nullptr, weights,
                                 range, rows, workspace, heads, dim);
      return true;
    case GLM5_HAL_FP8_E4M3:
      launch_logits<QElem, Fp8E4M3>(rows_count, workspace_cols, shared_bytes, stream, q, keys, key_scale,
                                    weights, range, rows, workspace, heads, dim);
      return true;
    default:
      return false;
  }
}

// Validates, then runs both kernels. Float keys must share q's dtype; FP8 keys need a scale.
template <class Range, class Rows>
int run(const void* q, const void* keys, const float* key_scale, const float* weights, Range range, Rows rows,
        float* workspace, int64_t workspace_cols, int32_t* out, int64_t rows_count, int64_t heads, int64_t dim,
        int64_t key_rows, int64_t topk, int q_dtype, int k_dtype, void* stream) {
  if (rows_count < 0 || rows_count > 2147483647 || heads < 1 || dim < 1 || heads > 1024 ||
      heads * dim > GLM5_HAL_GPU_INDEXER_MAX_QROW || topk < 1 || topk > 2147483647 || workspace_cols < 0 ||
      (workspace_cols + kLogitThreads - 1) / kLogitThreads > 65535 || key_rows < 0) {
    return GLM5_HAL_EINVAL;
  }
  const bool fp8 = k_dtype == GLM5_HAL_FP8_E4M3;
  if ((fp8 && key_scale == nullptr) || (!fp8 && k_dtype != q_dtype)) return GLM5_HAL_EINVAL;
  if (rows_count == 0) return GLM5_HAL_OK;
  if (q == nullptr || weights == nullptr || out == nullptr || (key_rows > 0 && keys == nullptr) ||
      (workspace_cols > 0 && workspace == nullptr)) {
    return GLM5_HAL_EINVAL;
  }
  const cudaStream_t s = as_stream(stream);
  if (workspace_cols > 0) {
    const size_t shared_bytes = static_cast<size_t>(heads * dim + heads) * sizeof(float);
    bool known = false;
    switch (q_dtype) {
      case GLM5_HAL_F32:
        known = dispatch_keys<F32>(k_dtype, rows_count, workspace_cols, shared_bytes, s, q, keys, key_scale,
                                   weights, range, rows, workspace, heads, dim);
        break;
      case GLM5_HAL_F16:
        known = dispatch_keys<F16>(k_dtype, rows_count, workspace_cols, shared_bytes, s, q, keys, key_scale,
                                   weights, range, rows, workspace, heads, dim);
        break;
      case GLM5_HAL_BF16:
        known = dispatch_keys<BF16>(k_dtype, rows_count, workspace_cols, shared_bytes, s, q, keys, key_scale,
                                    weights, range, rows, workspace, heads, dim);
        break;
      default:
        break;
    }
    if (!known) return GLM5_HAL_EINVAL;
    const int status = launch_status();
    if (status != GLM5_HAL_OK) return status;
  } else if ((q_dtype < GLM5_HAL_F32 || q_dtype > GLM5_HAL_BF16)) {
    return GLM5_HAL_EINVAL;
  }
  indexer_select_kernel<Range><<<static_cast<unsigned>(rows_count), kSelectThreads, 0, s>>>(
      workspace, workspace_cols, range, out, topk);
  return launch_status();
}

}  // namespace
}  // namespace glm5_hal_gpu

extern "C" int glm5_hal_gpu_indexer_topk(const void* q, const void* keys, const float* key_scale,
                                         const float* weights, const int32_t* k_start, const int32_t* k_end,
                                         float* workspace, int64_t workspace_cols, int32_t* out, int64_t rows,
                                         int64_t heads, int64_t dim, int64_t num_keys, int64_t topk, int q_dtype,
                                         int k_dtype, void* stream) {
  using namespace glm5_hal_gpu;
  if (rows > 0 && (k_start == nullptr || k_end == nullptr)) return GLM5_HAL_EINVAL;
  return run(q, keys, key_scale, weights, FlatRange{k_start, k_end}, FlatRows{num_keys}, workspace,
             workspace_cols, out, rows, heads, dim, num_keys, topk, q_dtype, k_dtype, stream);
}

extern "C" int glm5_hal_gpu_indexer_topk_paged(const void* q, const void* key_cache, const float* key_scale,
                                               const float* weights, const int32_t* block_table,
                                               const int32_t* context_lens, float* workspace,
                                               int64_t workspace_cols, int32_t* out, int64_t batch,
                                               int64_t queries_per_seq, int64_t heads, int64_t dim,
                                               int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                               int64_t topk, int q_dtype, int k_dtype, void* stream) {
  using namespace glm5_hal_gpu;
  if (batch < 0 || queries_per_seq < 1 || num_blocks < 0 || block_size < 1 || max_blocks < 0) {
    return GLM5_HAL_EINVAL;
  }
  if (batch > 0 && (context_lens == nullptr || (max_blocks > 0 && block_table == nullptr))) {
    return GLM5_HAL_EINVAL;
  }
  return run(q, key_cache, key_scale, weights, PagedRange{context_lens, queries_per_seq},
             PagedRows{block_table, queries_per_seq, num_blocks, block_size, max_blocks}, workspace,
             workspace_cols, out, batch * queries_per_seq, heads, dim, num_blocks * block_size, topk, q_dtype,
             k_dtype, stream);
}
