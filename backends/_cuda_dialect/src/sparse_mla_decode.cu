// Sparse MLA attention (absorbed / MQA mode) over a paged latent cache: the CUDA-dialect
// implementation of glm5_hal_sparse_mla_decode_paged (glm5_hal_kernel_abi.h), behind
// sparse_mla_decode_paged and sparse_mla_attention (OPS.md 4.2) on backends whose vendor
// library has no sparse attention for the call (MUSA before the S5000, any DCU).
//
// One block per (query token, head). The block walks the token's top-k indices in chunks
// of kThreads: each thread scores one index (a full q . kv dot product), the block keeps
// an online softmax (running max and sum), and each thread accumulates its slice of the
// d_v output dims. A portable baseline: correct for any warp width and tile remainder,
// not tuned (no tensor cores, uncoalesced score loads).
#include "block_reduce.cuh"
#include "gpu_runtime.h"
#include "numeric.cuh"

namespace glm5_hal_gpu {
namespace {

constexpr int kThreads = 128;
constexpr int kAccPerThread = GLM5_HAL_GPU_MLA_MAX_DV / kThreads;

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

template <class Elem>
__global__ void __launch_bounds__(kThreads)
    sparse_mla_decode_kernel(const typename Elem::Storage* __restrict__ q,
                             const typename Elem::Storage* __restrict__ kv,
                             const int32_t* __restrict__ block_table, const int32_t* __restrict__ context_lens,
                             const int32_t* __restrict__ indices, typename Elem::Storage* __restrict__ out,
                             float* __restrict__ lse, int64_t queries_per_seq, int64_t heads, int64_t dqk,
                             int64_t d_v, int64_t topk, int64_t num_blocks, int64_t block_size,
                             int64_t max_blocks, float sm_scale) {
  __shared__ float q_row[GLM5_HAL_GPU_MLA_MAX_DQK];
  __shared__ float probs[kThreads];
  __shared__ int64_t rows[kThreads];
  __shared__ float scratch[kThreads];

  const int64_t token = blockIdx.x;
  const int64_t head = blockIdx.y;
  const int64_t sequence = token / queries_per_seq;
  const int tid = threadIdx.x;
  const int64_t context = context_lens[sequence];
  const int32_t* table_row = block_table + sequence * max_blocks;
  const int32_t* token_indices = indices + token * topk;

  const typename Elem::Storage* q_head = q + (token * heads + head) * dqk;
  for (int64_t d = tid; d < dqk; d += kThreads) q_row[d] = Elem::load(q_head, d);
  __syncthreads();

  float acc[kAccPerThread];
  for (int a = 0; a < kAccPerThread; ++a) acc[a] = 0.f;
  float running_max = -INFINITY;
  float running_sum = 0.f;

  for (int64_t first = 0; first < topk; first += kThreads) {
    const int64_t j = first + tid;
    float score = -INFINITY;
    int64_t row = -1;
    if (j < topk) {
      row = cache_row(token_indices[j], context, table_row, max_blocks, num_blocks, block_size);
      if (row >= 0) {
        const typename Elem::Storage* key = kv + row * dqk;
        float dot = 0.f;
        for (int64_t d = 0; d < dqk; ++d) dot += q_row[d] * Elem::load(key, d);
        score = dot * sm_scale;
      }
    }
    rows[tid] = row;
    // block_max's barriers also publish rows[] to the whole block
    const float new_max = fmaxf(running_max, block_max<kThreads>(score, scratch));
    if (new_max == -INFINITY) continue;  // uniform: no valid index so far in any thread
    const float rescale = expf(running_max - new_max);  // 0 while running_max is -inf
    const float weight = row >= 0 ? expf(score - new_max) : 0.f;
    probs[tid] = weight;
    running_sum = running_sum * rescale + block_sum<kThreads>(weight, scratch);
    const int64_t chunk = topk - first < kThreads ? topk - first : kThreads;
    for (int a = 0; a < kAccPerThread; ++a) {
      const int64_t d = tid + static_cast<int64_t>(a) * kThreads;
      if (d >= d_v) break;
      float value = acc[a] * rescale;
      for (int64_t c = 0; c < chunk; ++c) {
        if (rows[c] >= 0) value += probs[c] * Elem::load(kv + rows[c] * dqk, d);
      }
      acc[a] = value;
    }
    running_max = new_max;
    __syncthreads();  // rows[] and probs[] are rewritten by the next chunk
  }

  typename Elem::Storage* out_head = out + (token * heads + head) * d_v;
  const bool any_valid = running_sum > 0.f;
  const float inverse = any_valid ? 1.f / running_sum : 0.f;
  for (int a = 0; a < kAccPerThread; ++a) {
    const int64_t d = tid + static_cast<int64_t>(a) * kThreads;
    if (d >= d_v) break;
    Elem::store(out_head, d, acc[a] * inverse);
  }
  if (tid == 0) lse[token * heads + head] = any_valid ? running_max + logf(running_sum) : -INFINITY;
}

template <class Elem>
void launch(const glm5_hal_sparse_mla_decode_args& a, cudaStream_t stream) {
  typedef typename Elem::Storage S;
  const dim3 grid(static_cast<unsigned>(a.batch * a.queries_per_seq), static_cast<unsigned>(a.heads));
  sparse_mla_decode_kernel<Elem><<<grid, kThreads, 0, stream>>>(
      static_cast<const S*>(a.q), static_cast<const S*>(a.kv_cache), a.block_table, a.context_lens, a.indices,
      static_cast<S*>(a.out), a.lse, a.queries_per_seq, a.heads, a.dqk, a.d_v, a.topk, a.num_blocks,
      a.block_size, a.max_blocks, a.sm_scale);
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
