// MoE permutation (docs/ops/moe.md): moe_permute as an index pass plus a row gather, and
// moe_unpermute as a weighted scatter-add.
//
// moe_permute's row order is part of the contract (by expert, then by ascending flat index
// t*k + j), so placement is not done with atomics: one block per expert counts its entries,
// then walks the flat ids in order with a block-wide prefix sum, writing its rows at its
// offset (the sum of the counts of the experts before it). O(E * T * k) reads: a portable
// baseline, deterministic and simple. moe_unpermute adds rows into a float32 workspace with
// atomicAdd (summation order unspecified; float32 accumulation as the contract asks).
#include "gpu_runtime.h"
#include "numeric.cuh"

namespace glm5_hal_gpu {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int block_sum_int(int value, int* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const int result = scratch[0];
  __syncthreads();
  return result;
}

__global__ void __launch_bounds__(kThreads)
    moe_count_kernel(const int32_t* __restrict__ ids, int64_t entries, int32_t* __restrict__ counts) {
  __shared__ int scratch[kThreads];
  const int expert = blockIdx.x;
  int mine = 0;
  for (int64_t i = threadIdx.x; i < entries; i += kThreads) mine += ids[i] == expert;
  const int total = block_sum_int(mine, scratch);
  if (threadIdx.x == 0) counts[expert] = total;
}

__global__ void __launch_bounds__(kThreads)
    moe_place_kernel(const int32_t* __restrict__ ids, int64_t entries, const int32_t* __restrict__ counts,
                     int32_t* __restrict__ src) {
  __shared__ int scratch[kThreads];
  __shared__ int prefix[kThreads];
  const int expert = blockIdx.x;
  const int tid = threadIdx.x;
  int before = 0;
  for (int e = tid; e < expert; e += kThreads) before += counts[e];
  int64_t next = block_sum_int(before, scratch);
  for (int64_t first = 0; first < entries; first += kThreads) {
    const int64_t i = first + tid;
    const int flag = i < entries && ids[i] == expert;
    // inclusive Hillis-Steele scan of the flags of this chunk
    prefix[tid] = flag;
    __syncthreads();
    for (int stride = 1; stride < kThreads; stride <<= 1) {
      const int add = tid >= stride ? prefix[tid - stride] : 0;
      __syncthreads();
      prefix[tid] += add;
      __syncthreads();
    }
    if (flag) src[next + prefix[tid] - 1] = static_cast<int32_t>(i);
    next += prefix[kThreads - 1];
    __syncthreads();  // prefix[] is rewritten by the next chunk
  }
}

__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const uint8_t* __restrict__ x, const int32_t* __restrict__ src, int64_t k, int64_t tokens,
                       int64_t row_bytes, uint8_t* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const int64_t s = src[r];
  if (s < 0 || s >= tokens * k) return;
  const uint8_t* from = x + (s / k) * row_bytes;
  uint8_t* to = out + r * row_bytes;
  for (int64_t b = threadIdx.x; b < row_bytes; b += kThreads) to[b] = from[b];
}

__global__ void zero_kernel(float* __restrict__ data, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) data[i] = 0.f;
}

template <class Elem>
__global__ void __launch_bounds__(kThreads)
    unpermute_add_kernel(const typename Elem::Storage* __restrict__ y, const int32_t* __restrict__ src,
                         const float* __restrict__ weights, float* __restrict__ acc, int64_t tokens, int64_t k,
                         int64_t dim) {
  const int64_t r = blockIdx.x;
  const int64_t s = src[r];
  if (s < 0 || s >= tokens * k) return;
  const float w = weights[s];
  float* row = acc + (s / k) * dim;
  for (int64_t d = threadIdx.x; d < dim; d += kThreads) atomicAdd(row + d, w * Elem::load(y, r * dim + d));
}

template <class Elem>
__global__ void store_kernel(const float* __restrict__ acc, typename Elem::Storage* __restrict__ out, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    Elem::store(out, i, acc[i]);
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks > 65535 ? 65535 : (blocks < 1 ? 1 : blocks));
}

template <class Elem>
void unpermute(const void* y, const int32_t* src, const float* weights, float* acc, void* out, int64_t rows,
               int64_t tokens, int64_t k, int64_t dim, cudaStream_t stream) {
  zero_kernel<<<grid_for(tokens * dim), kThreads, 0, stream>>>(acc, tokens * dim);
  if (rows > 0) {
    unpermute_add_kernel<Elem><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const typename Elem::Storage*>(y), src, weights, acc, tokens, k, dim);
  }
  store_kernel<Elem><<<grid_for(tokens * dim), kThreads, 0, stream>>>(
      acc, static_cast<typename Elem::Storage*>(out), tokens * dim);
}

}  // namespace
}  // namespace glm5_hal_gpu

extern "C" int glm5_hal_gpu_moe_permute_index(const int32_t* ids, int64_t tokens, int64_t k, int64_t num_experts,
                                              int32_t* tokens_per_expert, int32_t* src, void* stream) {
  using namespace glm5_hal_gpu;
  if (tokens < 0 || k < 1 || num_experts < 1 || num_experts > 2147483647 || tokens * k > 2147483647) {
    return GLM5_HAL_EINVAL;
  }
  if (tokens_per_expert == nullptr || (tokens > 0 && (ids == nullptr || src == nullptr))) return GLM5_HAL_EINVAL;
  const cudaStream_t s = as_stream(stream);
  const unsigned experts = static_cast<unsigned>(num_experts);
  moe_count_kernel<<<experts, kThreads, 0, s>>>(ids, tokens * k, tokens_per_expert);
  if (tokens > 0) moe_place_kernel<<<experts, kThreads, 0, s>>>(ids, tokens * k, tokens_per_expert, src);
  return launch_status();
}

extern "C" int glm5_hal_gpu_gather_rows(const void* x, const int32_t* src, int64_t rows, int64_t k, int64_t tokens,
                                        int64_t row_bytes, void* out, void* stream) {
  using namespace glm5_hal_gpu;
  if (rows < 0 || rows > 2147483647 || k < 1 || tokens < 0 || row_bytes < 0) return GLM5_HAL_EINVAL;
  if (rows == 0 || row_bytes == 0) return GLM5_HAL_OK;
  if (x == nullptr || src == nullptr || out == nullptr) return GLM5_HAL_EINVAL;
  gather_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(
      static_cast<const uint8_t*>(x), src, k, tokens, row_bytes, static_cast<uint8_t*>(out));
  return launch_status();
}

extern "C" int glm5_hal_gpu_moe_unpermute(const void* y, const int32_t* src, const float* weights, float* workspace,
                                          void* out, int64_t rows, int64_t tokens, int64_t k, int64_t dim, int dtype,
                                          void* stream) {
  using namespace glm5_hal_gpu;
  if (rows < 0 || rows > 2147483647 || tokens < 0 || k < 1 || dim < 0) return GLM5_HAL_EINVAL;
  if (tokens == 0 || dim == 0) return GLM5_HAL_OK;
  if (workspace == nullptr || out == nullptr || (rows > 0 && (y == nullptr || src == nullptr || weights == nullptr))) {
    return GLM5_HAL_EINVAL;
  }
  const cudaStream_t s = as_stream(stream);
  switch (dtype) {
    case GLM5_HAL_F32: unpermute<F32>(y, src, weights, workspace, out, rows, tokens, k, dim, s); break;
    case GLM5_HAL_F16: unpermute<F16>(y, src, weights, workspace, out, rows, tokens, k, dim, s); break;
    case GLM5_HAL_BF16: unpermute<BF16>(y, src, weights, workspace, out, rows, tokens, k, dim, s); break;
    default: return GLM5_HAL_EINVAL;
  }
  return launch_status();
}
