// MoE token permutation (OPS.md section 5). Index tensors are int32, row-major.
#pragma once

#include "core.h"

namespace glm5 {

// DeepSeek-V3 / GLM-5 routing of logits[T, E] (row stride logits_row_stride elements, a float
// dtype): s = sigmoid(logits) (softmax over E when `softmax`), c = s + bias (bias[E] in
// bias_dtype, or null); with n_group > 1 only the topk_group groups of E / n_group contiguous
// experts with the largest sum of their top-2 c compete; ids[T, top_k] = the experts of the
// top_k largest c, in descending order of c (ties: lower index first; nan ranks highest);
// weights[T, top_k] = s[ids], divided by their sum + 1e-20 when norm_topk_prob, times
// routed_scaling_factor. float32 throughout; outputs contiguous.
void moe_route(float* weights, int32_t* ids, const void* logits, DType logits_dtype, int64_t tokens, int64_t experts,
               int64_t logits_row_stride, const void* bias, DType bias_dtype, int64_t top_k, int64_t n_group,
               int64_t topk_group, float routed_scaling_factor, bool norm_topk_prob, bool softmax, int num_threads);

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
