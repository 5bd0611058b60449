// MUSA glue for the shared CUDA-dialect kernels (backends/_cuda_dialect/src): the four CUDA
// runtime names those sources use, mapped to MUSA's runtime, as torch_musa's porting tool
// (simple_porting / musify) rewrites them (cuda* -> musa*). Compiled with mcc only.
//
// NOT COMPILED HERE: no MUSA SDK on the development machine. Unverified on mcc.
#pragma once

#include <musa_runtime.h>

#define cudaStream_t musaStream_t
#define cudaError_t musaError_t
#define cudaSuccess musaSuccess
#define cudaGetLastError musaGetLastError
