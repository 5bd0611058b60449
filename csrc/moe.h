// MoE token permutation (OPS.md section 5). Index tensors are int32, row-major.
#pragma once

#include "core.h"

namespace glm5 {

// Routing plan of moe_permute: for the valid entries (0 <= ids[t, j] < num_experts) of
// ids[T, k] (rows ids_row_stride apart), writes tokens_per_expert[num_experts] and
// src[0, M) (flat indices t*k + j grouped by expert ascending, ascending within an expert;
// `src` must hold T*k entries) and returns M. Entries outside [0, num_experts) are dropped.
int64_t moe_permute_plan(int32_t* tokens_per_expert, int32_t* src, const int32_t* ids, int64_t tokens,
                         int64_t k, int64_t ids_row_stride, int64_t num_experts);

// x_perm[r, :] = x[src[r] / k, :] for r < rows: rows of `row_bytes` bytes, x rows
// x_row_stride_bytes apart, x_perm contiguous. Every src must lie in [0, tokens * k).
void moe_permute_gather(void* x_perm, const void* x, int64_t tokens, int64_t row_bytes,
                        int64_t x_row_stride_bytes, const int32_t* src, int64_t rows, int64_t k,
                        int num_threads);

// out[t, :] = sum over rows r with src[r] / k == t of weights[t, src[r] % k] * y[r, :], in
// float32 (rows of one slot in row order, slots in j order); tokens without rows get 0.
// y[rows, dim] (row stride y_row_stride), out[tokens, dim] contiguous, weights[tokens, k]
// float32 contiguous. Every src must lie in [0, tokens * k).
void moe_unpermute(void* out, const void* y, int64_t rows, int64_t dim, int64_t y_row_stride,
                   const int32_t* src, const float* weights, int64_t tokens, int64_t k, DType dtype,
                   int num_threads);

}  // namespace glm5
