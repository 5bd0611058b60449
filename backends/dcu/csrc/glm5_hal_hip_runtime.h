// HIP glue for the shared CUDA-dialect kernels (backends/_cuda_dialect/src): the four CUDA
// runtime names those sources use, mapped to HIP, exactly as hipify rewrites them. Hygon's
// DTK ships a ROCm-compatible HIP (hipcc under ROCM_PATH). Compiled with hipcc only.
//
// NOT COMPILED HERE: no ROCm/DTK on the development machine. Unverified on hipcc.
#pragma once

#include <hip/hip_runtime.h>

#define cudaStream_t hipStream_t
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaGetLastError hipGetLastError
