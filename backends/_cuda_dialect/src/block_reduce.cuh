// Block-wide reductions through shared memory and __syncthreads only: correct for any
// warp / wavefront width (32 on NVIDIA, 64 on DCU, MUSA's own), unlike shuffle intrinsics.
#pragma once

#include "gpu_runtime.h"

namespace glm5_hal_gpu {

// kThreads (a power of two) threads each contribute `value`; every thread gets the result.
// `scratch` holds kThreads floats of shared memory; it is free again when this returns.
template <int kThreads>
__device__ __forceinline__ float block_max(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) {
      scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  const float result = scratch[0];
  __syncthreads();
  return result;
}

template <int kThreads>
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) {
      scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    }
    __syncthreads();
  }
  const float result = scratch[0];
  __syncthreads();
  return result;
}

}  // namespace glm5_hal_gpu
