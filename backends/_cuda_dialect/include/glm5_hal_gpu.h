// C ABI of glm5_hal's CUDA-dialect kernels (backends/_cuda_dialect/src/*.cu).
//
// One set of sources, three builds: nvcc (CUDA), mcc (Moore Threads MUSA) and hipcc (Hygon
// DCU / ROCm), each producing a shared library with exactly these symbols, plus the paged
// sparse MLA decode entry point every glm5_hal kernel library shares
// (glm5_hal_kernel_abi.h, in core/glm5_hal/include):
//   libglm5_hal_cuda_kernels.so   (glm5_hal/backends/_cuda_dialect/)
//   libglm5_hal_musa_kernels.so   (glm5_hal/backends/musa/)
//   libglm5_hal_dcu_kernels.so    (glm5_hal/backends/dcu/)
// Python binds them with ctypes (glm5_hal/backends/_cuda_dialect/__init__.py), so the ABI is
// plain C: raw device pointers, sizes, the dtype codes of glm5_hal_kernel_abi.h and the
// stream to enqueue on. Every tensor is contiguous (the Python side makes it so). Every
// entry point validates its sizes on the host before launching and returns GLM5_HAL_OK,
// GLM5_HAL_EINVAL (nothing launched), or a positive runtime error code (cudaError_t /
// musaError_t / hipError_t of the launch).
//
// Indices read from device memory (block tables, sparse indices, slots) are validated in the
// kernels before any dereference: an out-of-range entry is treated as invalid (skipped),
// never read through.
#pragma once

#include <stdint.h>

#include "glm5_hal_kernel_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GLM5_HAL_GPU_ABI_VERSION 2

// Limits the host checks enforce (the kernels keep one query row in shared memory and one
// block-wide reduction buffer per block).
#define GLM5_HAL_GPU_MLA_MAX_DQK 1024       // q row of the sparse MLA decode kernel, in floats
#define GLM5_HAL_GPU_MLA_MAX_DV 1024        // 128 threads x 8 accumulators
#define GLM5_HAL_GPU_INDEXER_MAX_QROW 8192  // heads * dim of one indexer query row, in floats

// Which toolchain built this library: "cuda", "musa" or "hip".
const char* glm5_hal_gpu_target(void);
int glm5_hal_gpu_abi_version(void);

// Lightning-indexer top-k over flat keys.
//   q        [rows, heads, dim] q_dtype (F32/F16/BF16)
//   keys     [num_keys, dim] k_dtype (F32/F16/BF16, or FP8_E4M3 with key_scale [num_keys] float32)
//   weights  [rows, heads] float32
//   k_start, k_end [rows] int32, 0 <= k_start <= k_end <= num_keys
//   workspace [rows, workspace_cols] float32, workspace_cols >= max(k_end - k_start)
//   out      [rows, topk] int32: positions s of the topk largest
//            logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . keys[s]) over [k_start, k_end),
//            left-packed in unspecified order, -1 padded.
int glm5_hal_gpu_indexer_topk(const void* q, const void* keys, const float* key_scale,
                              const float* weights, const int32_t* k_start, const int32_t* k_end,
                              float* workspace, int64_t workspace_cols, int32_t* out, int64_t rows,
                              int64_t heads, int64_t dim, int64_t num_keys, int64_t topk, int q_dtype,
                              int k_dtype, void* stream);

// Lightning-indexer top-k for decode over a paged key cache.
//   q            [batch * queries_per_seq, heads, dim]
//   key_cache    [num_blocks * block_size, dim] (key_scale [num_blocks * block_size] for FP8)
//   block_table  [batch, max_blocks] int32, context_lens [batch] int32
//   query i of sequence b sees logical positions [0, context_lens[b] - queries_per_seq + i + 1)
//   workspace    [batch * queries_per_seq, workspace_cols], workspace_cols >= max context_lens
//   out          [batch * queries_per_seq, topk] int32 logical positions, -1 padded.
int glm5_hal_gpu_indexer_topk_paged(const void* q, const void* key_cache, const float* key_scale,
                                    const float* weights, const int32_t* block_table,
                                    const int32_t* context_lens, float* workspace,
                                    int64_t workspace_cols, int32_t* out, int64_t batch,
                                    int64_t queries_per_seq, int64_t heads, int64_t dim,
                                    int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                    int64_t topk, int q_dtype, int k_dtype, void* stream);

// cache_rows[slot[t]] = values[t] (row_bytes bytes each) for every t with slot[t] >= 0;
// slots outside [0, num_slots) are skipped. slot_mapping is int64 when slots_are_int64, else int32.
int glm5_hal_gpu_kv_cache_write(void* cache, const void* values, const void* slot_mapping,
                                int slots_are_int64, int64_t tokens, int64_t row_bytes,
                                int64_t num_slots, void* stream);

// out[r, i] = silu(x[r, i]) * x[r, half + i] in float32, rounded once; x [rows, 2 * half].
int glm5_hal_gpu_silu_and_mul(const void* x, void* out, int64_t rows, int64_t half, int dtype,
                              void* stream);

// moe_permute's index pass: tokens_per_expert[e] = count of ids == e over ids [tokens, k]
// (int32; other values, e.g. -1, are dropped); src [tokens * k capacity] receives the flat
// indices t * k + j of the kept entries grouped by expert ascending, then by ascending flat
// index (its first sum(tokens_per_expert) entries are written).
int glm5_hal_gpu_moe_permute_index(const int32_t* ids, int64_t tokens, int64_t k, int64_t num_experts,
                                   int32_t* tokens_per_expert, int32_t* src, void* stream);

// out[r] = x[src[r] / k] for r < rows (row_bytes bytes each; x has `tokens` rows); rows whose
// src is outside [0, tokens * k) are left unwritten.
int glm5_hal_gpu_gather_rows(const void* x, const int32_t* src, int64_t rows, int64_t k, int64_t tokens,
                             int64_t row_bytes, void* out, void* stream);

// moe_unpermute: out[t] = sum over rows r with src[r] / k == t of weights[src[r]] * y[r],
// accumulated in float32 in workspace [tokens, dim] (overwritten) and rounded once into out
// [tokens, dim] (dtype); y [rows, dim], weights [tokens, k] float32.
int glm5_hal_gpu_moe_unpermute(const void* y, const int32_t* src, const float* weights, float* workspace,
                               void* out, int64_t rows, int64_t tokens, int64_t k, int64_t dim, int dtype,
                               void* stream);

#ifdef __cplusplus
}
#endif
