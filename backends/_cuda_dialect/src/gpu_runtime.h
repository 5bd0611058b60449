// The runtime names the CUDA-dialect sources use, and where they come from per toolchain.
//
// The sources are plain CUDA: they use exactly four runtime names (cudaStream_t, cudaError_t,
// cudaSuccess, cudaGetLastError) plus the device built-ins every CUDA-like dialect shares
// (__global__, __shared__, __syncthreads, atomicAdd on shared int, __float_as_uint,
// __uint_as_float). No warp intrinsics (the warp is 32 lanes on NVIDIA, a 64-lane wavefront
// on DCU, and differs again on MUSA): every reduction goes through shared memory and
// __syncthreads. No vendor half/bfloat16 types: 16-bit and FP8 values are handled as raw
// bits (numeric.cuh).
//
// The per-vendor glue header maps the four runtime names -- the whole of what musify or
// hipify would rewrite in these files:
//   GLM5_HAL_GPU_MUSA -> backends/musa/csrc/glm5_hal_musa_runtime.h (mcc)
//   GLM5_HAL_GPU_HIP  -> backends/dcu/csrc/glm5_hal_hip_runtime.h   (hipcc)
//   GLM5_HAL_GPU_SIM  -> tests/emulators/cuda_sim/glm5_hal_sim_runtime.h: a CPU thread per
//                        GPU thread, so tests run these kernels on the host (g++)
//   none of these     -> <cuda_runtime.h>                           (nvcc)
#pragma once

#if defined(GLM5_HAL_GPU_MUSA)
#include "glm5_hal_musa_runtime.h"
#define GLM5_HAL_GPU_TARGET "musa"
#elif defined(GLM5_HAL_GPU_HIP)
#include "glm5_hal_hip_runtime.h"
#define GLM5_HAL_GPU_TARGET "hip"
#elif defined(GLM5_HAL_GPU_SIM)
#include "glm5_hal_sim_runtime.h"
#define GLM5_HAL_GPU_TARGET "sim"
#else
#include <cuda_runtime.h>
#define GLM5_HAL_GPU_TARGET "cuda"
#endif

#include <stdint.h>

#include "glm5_hal_gpu.h"

namespace glm5_hal_gpu {

// The launch status as the ABI returns it: 0, or the runtime's (positive) error code.
inline int launch_status() {
  cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? GLM5_HAL_OK : static_cast<int>(error);
}

inline cudaStream_t as_stream(void* stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace glm5_hal_gpu
