// Sparse MLA attention (absorbed / MQA mode) over a paged latent cache: the CUDA-dialect
// implementation of glm5_hal_sparse_mla_decode_paged (glm5_hal_kernel_abi.h), behind
// sparse_mla_decode_paged and sparse_mla_attention (docs/ops/dsa.md) on the cuda backend and on
// vendor backends whose own library has no sparse attention for the call (MUSA before the
// S5000, any DCU).
//
// MLA decode is MQA: every head of a query token reads the same top-k cache rows. So one
// block serves one query token and a group of kHeads heads (32; 16 when d_v > 512): it
// gathers a tile of kRows of the token's rows once and scores and accumulates them for all
// heads of the group, instead of one block per head reading each row H times. Per tile:
//   1. the rows' physical slots (invalid positions: -1, never read) ;
//   2. scores S[head][row] = sm_scale * q[head] . kv[row], over Dqk in chunks of kDChunk
//      dims staged in shared memory (q chunk and kv chunk), each thread owning one row and
//      kHeads / 4 heads;
//   3. per head, the tile's max and the online-softmax update (running max, running sum,
//      the factor that rescales the accumulators), probabilities written over the scores;
//   4. out[head][d] += p[head][row] * kv[row][d] over the first d_v dims, in chunks staged
//      in shared memory; each thread owns one dim of each chunk and kHeads / 4 heads, all
//      d_v outputs of the group living in registers (64 per thread).
// The cache is therefore read ceil(H / kHeads) times per token (twice for GLM-5's 64 heads:
// once for the scores, and the first d_v dims again for the values, which a GPU serves from
// L1/L2). Portable: shared memory and __syncthreads only, no warp intrinsics, no tensor
// cores -- correct for any warp width and tile remainder. On NVIDIA's sm_90/sm_100 the cuda
// backend prefers FlashMLA when it is installed.
#include "gpu_runtime.h"
#include "numeric.cuh"

namespace glm5_hal_gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 64;                  // cache rows per tile
constexpr int kDChunk = 64;                // dims staged per step
constexpr int kPad = kDChunk + 1;          // shared row stride: a warp reading one dim of 32 rows hits 32 banks
constexpr int kRowGroups = kThreads / kRows;     // 4: thread t scores row t % kRows for heads t / kRows + 4i
constexpr int kDimGroups = kThreads / kDChunk;   // 4: thread t accumulates dim t % kDChunk for heads t / kDChunk + 4i
static_assert(kRowGroups == kDimGroups, "scores and values split the heads the same way");

// The physical cache row of logical position p of sequence b, or -1 when p is not valid
// (outside [0, context), or its block id outside the table or the cache).
__device__ __forceinline__ int64_t cache_row(int64_t p, int64_t context, const int32_t* table_row,
                                             int64_t max_blocks, int64_t num_blocks, int64_t block_size) {
  if (p < 0 || p >= context) return -1;
  const int64_t block = p / block_size;
  if (block >= max_blocks) return -1;
  const int64_t id = table_row[block];
  if (id < 0 || id >= num_blocks) return -1;
  return id * block_size + p % block_size;
}

template <class Elem, int kHeads, int kMaxDv>
__global__ void __launch_bounds__(kThreads)
    sparse_mla_decode_kernel(const typename Elem::Storage* __restrict__ q,
                             const typename Elem::Storage* __restrict__ kv,
                             const int32_t* __restrict__ block_table, const int32_t* __restrict__ context_lens,
                             const int32_t* __restrict__ indices, typename Elem::Storage* __restrict__ out,
                             float* __restrict__ lse, int64_t queries_per_seq, int64_t heads, int64_t dqk,
                             int64_t d_v, int64_t topk, int64_t num_blocks, int64_t block_size,
                             int64_t max_blocks, float sm_scale) {
  constexpr int kHeadsPerThread = kHeads / kRowGroups;  // heads a thread scores / accumulates
  constexpr int kChunks = kMaxDv / kDChunk;             // value chunks of the widest d_v
  constexpr int kParts = kThreads / kHeads;             // threads sharing one head's softmax update
  constexpr int kRowsPerPart = kRows / kParts;
  static_assert(kHeads % kRowGroups == 0 && kThreads % kHeads == 0 && kRows % kParts == 0, "tile shape");

  __shared__ float q_chunk[kHeads][kPad];
  __shared__ float kv_chunk[kRows][kPad];
  __shared__ float probs[kHeads][kRows];     // scores, then probabilities
  __shared__ int64_t rows[kRows];
  __shared__ float partial[kHeads][kParts];
  __shared__ float running_max[kHeads];
  __shared__ float running_sum[kHeads];
  __shared__ float rescale[kHeads];
  __shared__ int valid_rows;

  const int64_t token = blockIdx.x;
  const int64_t head0 = static_cast<int64_t>(blockIdx.y) * kHeads;
  const int64_t sequence = token / queries_per_seq;
  const int tid = threadIdx.x;
  const int64_t context = context_lens[sequence];
  const int32_t* table_row = block_table + sequence * max_blocks;
  const int32_t* token_indices = indices + token * topk;
  const typename Elem::Storage* q_token = q + token * heads * dqk;
  const int64_t group_heads = heads - head0 < kHeads ? heads - head0 : kHeads;

  // thread roles
  const int my_row = tid % kRows;            // scores: one row ...
  const int my_dim = tid % kDChunk;          // values: one dim of each chunk ...
  const int head_lane = tid / kRows;         // ... for heads head_lane + kRowGroups * i
  const int softmax_head = tid / kParts;     // softmax: one head ...
  const int softmax_part = tid % kParts;     // ... rows [part * kRowsPerPart, +kRowsPerPart)

  if (tid < kHeads) {
    running_max[tid] = -INFINITY;
    running_sum[tid] = 0.f;
  }
  float acc[kChunks * kHeadsPerThread];
#pragma unroll
  for (int a = 0; a < kChunks * kHeadsPerThread; ++a) acc[a] = 0.f;

  for (int64_t first = 0; first < topk; first += kRows) {
    // 1. the tile's rows
    if (tid == 0) valid_rows = 0;
    __syncthreads();  // also: the previous tile is done with rows[], probs[] and kv_chunk[]
    if (tid < kRows) {
      const int64_t j = first + tid;
      const int64_t row = j < topk ? cache_row(token_indices[j], context, table_row, max_blocks, num_blocks,
                                               block_size)
                                   : -1;
      rows[tid] = row;
      if (row >= 0) atomicAdd(&valid_rows, 1);
    }
    __syncthreads();
    if (valid_rows == 0) continue;  // uniform: nothing to add from this tile

    // 2. scores over Dqk
    float score[kHeadsPerThread];
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; ++i) score[i] = 0.f;
    for (int64_t d0 = 0; d0 < dqk; d0 += kDChunk) {
      const int64_t width = dqk - d0 < kDChunk ? dqk - d0 : kDChunk;
      for (int e = tid; e < kHeads * kDChunk; e += kThreads) {
        const int h = e / kDChunk, d = e % kDChunk;
        q_chunk[h][d] = h < group_heads && d < width ? Elem::load(q_token + (head0 + h) * dqk, d0 + d) : 0.f;
      }
      for (int e = tid; e < kRows * kDChunk; e += kThreads) {
        const int j = e / kDChunk, d = e % kDChunk;
        kv_chunk[j][d] = rows[j] >= 0 && d < width ? Elem::load(kv + rows[j] * dqk, d0 + d) : 0.f;
      }
      __syncthreads();
      for (int d = 0; d < width; ++d) {
        const float key = kv_chunk[my_row][d];
#pragma unroll
        for (int i = 0; i < kHeadsPerThread; ++i) score[i] += q_chunk[head_lane + kRowGroups * i][d] * key;
      }
      __syncthreads();  // the chunks are rewritten next
    }
    const bool my_row_valid = rows[my_row] >= 0;
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; ++i) {
      probs[head_lane + kRowGroups * i][my_row] = my_row_valid ? score[i] * sm_scale : -INFINITY;
    }
    __syncthreads();

    // 3. online softmax, per head
    float tile_max = -INFINITY;
    for (int j = softmax_part * kRowsPerPart; j < (softmax_part + 1) * kRowsPerPart; ++j) {
      tile_max = fmaxf(tile_max, probs[softmax_head][j]);
    }
    partial[softmax_head][softmax_part] = tile_max;
    __syncthreads();
    float new_max = running_max[softmax_head];
    for (int p = 0; p < kParts; ++p) new_max = fmaxf(new_max, partial[softmax_head][p]);
    float tile_sum = 0.f;
    for (int j = softmax_part * kRowsPerPart; j < (softmax_part + 1) * kRowsPerPart; ++j) {
      // an invalid row's -inf score becomes 0; no valid row so far keeps everything 0
      const float p = new_max == -INFINITY ? 0.f : expf(probs[softmax_head][j] - new_max);
      probs[softmax_head][j] = p;
      tile_sum += p;
    }
    __syncthreads();  // every thread has read partial[] (the maxima) and running_max[]
    partial[softmax_head][softmax_part] = tile_sum;
    __syncthreads();
    if (softmax_part == 0) {
      float sum = 0.f;
      for (int p = 0; p < kParts; ++p) sum += partial[softmax_head][p];
      const float old_max = running_max[softmax_head];
      // 0 while no valid row was seen before (old_max -inf): the accumulators are 0 anyway
      const float factor = new_max == -INFINITY ? 1.f : expf(old_max - new_max);
      rescale[softmax_head] = factor;
      running_sum[softmax_head] = running_sum[softmax_head] * factor + sum;
      running_max[softmax_head] = new_max;
    }
    __syncthreads();

    // 4. values: the first d_v dims of the same rows
    float factor[kHeadsPerThread];
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; ++i) factor[i] = rescale[head_lane + kRowGroups * i];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t d0 = static_cast<int64_t>(c) * kDChunk;
      if (d0 >= d_v) break;  // uniform
      const int64_t width = d_v - d0 < kDChunk ? d_v - d0 : kDChunk;
      for (int e = tid; e < kRows * kDChunk; e += kThreads) {
        const int j = e / kDChunk, d = e % kDChunk;
        kv_chunk[j][d] = rows[j] >= 0 && d < width ? Elem::load(kv + rows[j] * dqk, d0 + d) : 0.f;
      }
      __syncthreads();
      float value[kHeadsPerThread];
#pragma unroll
      for (int i = 0; i < kHeadsPerThread; ++i) value[i] = acc[c * kHeadsPerThread + i] * factor[i];
      for (int j = 0; j < kRows; ++j) {
        const float v = kv_chunk[j][my_dim];
#pragma unroll
        for (int i = 0; i < kHeadsPerThread; ++i) value[i] += probs[head_lane + kRowGroups * i][j] * v;
      }
#pragma unroll
      for (int i = 0; i < kHeadsPerThread; ++i) acc[c * kHeadsPerThread + i] = value[i];
      __syncthreads();  // kv_chunk is rewritten next
    }
  }

  // out = acc / running_sum; lse = running_max + log(running_sum) (natural log)
#pragma unroll
  for (int i = 0; i < kHeadsPerThread; ++i) {
    const int h = head_lane + kRowGroups * i;
    if (h >= group_heads) continue;
    const float total = running_sum[h];
    const float inverse = total > 0.f ? 1.f / total : 0.f;
    typename Elem::Storage* out_head = out + (token * heads + head0 + h) * d_v;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t d = static_cast<int64_t>(c) * kDChunk + my_dim;
      if (d < d_v) Elem::store(out_head, d, acc[c * kHeadsPerThread + i] * inverse);
    }
  }
  if (tid < group_heads) {
    const float total = running_sum[tid];
    lse[token * heads + head0 + tid] = total > 0.f ? running_max[tid] + logf(total) : -INFINITY;
  }
}

template <class Elem, int kHeads, int kMaxDv>
void launch_group(const glm5_hal_sparse_mla_decode_args& a, cudaStream_t stream) {
  typedef typename Elem::Storage S;
  const dim3 grid(static_cast<unsigned>(a.batch * a.queries_per_seq),
                  static_cast<unsigned>((a.heads + kHeads - 1) / kHeads));
  sparse_mla_decode_kernel<Elem, kHeads, kMaxDv><<<grid, kThreads, 0, stream>>>(
      static_cast<const S*>(a.q), static_cast<const S*>(a.kv_cache), a.block_table, a.context_lens, a.indices,
      static_cast<S*>(a.out), a.lse, a.queries_per_seq, a.heads, a.dqk, a.d_v, a.topk, a.num_blocks,
      a.block_size, a.max_blocks, a.sm_scale);
}

// Every thread keeps 64 accumulators: 32 heads x 512 dims, or 16 heads x 1024 dims.
template <class Elem>
void launch(const glm5_hal_sparse_mla_decode_args& a, cudaStream_t stream) {
  if (a.d_v <= 512) {
    launch_group<Elem, 32, 512>(a, stream);
  } else {
    launch_group<Elem, 16, GLM5_HAL_GPU_MLA_MAX_DV>(a, stream);
  }
}

}  // namespace
}  // namespace glm5_hal_gpu

extern "C" int glm5_hal_sparse_mla_decode_paged(const glm5_hal_sparse_mla_decode_args* args, void* stream) {
  using namespace glm5_hal_gpu;
  if (args == nullptr) return GLM5_HAL_EINVAL;
  const glm5_hal_sparse_mla_decode_args& a = *args;
  if (a.batch < 0 || a.queries_per_seq < 1 || a.heads < 1 || a.heads > 65535 || a.dqk < 1 ||
      a.dqk > GLM5_HAL_GPU_MLA_MAX_DQK || a.d_v < 1 || a.d_v > a.dqk || a.d_v > GLM5_HAL_GPU_MLA_MAX_DV ||
      a.topk < 1 || a.num_blocks < 0 || a.block_size < 1 || a.max_blocks < 0 || !(a.sm_scale > 0.f) ||
      isinf(a.sm_scale)) {
    return GLM5_HAL_EINVAL;
  }
  const int64_t tokens = a.batch * a.queries_per_seq;
  if (tokens == 0) return GLM5_HAL_OK;
  if (tokens > 2147483647 || a.q == nullptr || a.out == nullptr || a.lse == nullptr || a.indices == nullptr ||
      a.context_lens == nullptr || (a.max_blocks > 0 && a.block_table == nullptr) ||
      (a.num_blocks > 0 && a.kv_cache == nullptr)) {
    return GLM5_HAL_EINVAL;
  }
  const cudaStream_t s = as_stream(stream);
  switch (a.dtype) {
    case GLM5_HAL_F32:
      launch<F32>(a, s);
      break;
    case GLM5_HAL_F16:
      launch<F16>(a, s);
      break;
    case GLM5_HAL_BF16:
      launch<BF16>(a, s);
      break;
    default:
      return GLM5_HAL_EINVAL;
  }
  return launch_status();
}
