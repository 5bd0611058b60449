// MoE routing and token permutation (docs/ops/moe.md).
#pragma once

#include "view.h"

namespace glm5 {

// DeepSeek-V3 / GLM-5 routing of logits [T, E] (a float dtype, rows of any stride):
// s = sigmoid(logits) (softmax over E when `softmax`), c = s + bias (bias [E] of a float dtype,
// or null); with n_group > 1 only the topk_group groups of E / n_group contiguous experts with
// the largest sum of their top-2 c compete; ids [T, top_k] int32 = the experts of the top_k
// largest c, in descending order of c (ties: lower index first; nan ranks highest);
// weights [T, top_k] float32 = s[ids], divided by their sum + 1e-20 when norm_topk_prob, times
// routed_scaling_factor. top_k is the width of the outputs (both contiguous). float32 throughout.
void moe_route(const View& weights, const View& ids, const RowsIn& logits, const DenseIn* bias, int64_t n_group,
               int64_t topk_group, float routed_scaling_factor, bool norm_topk_prob, bool softmax, int num_threads);

// Routing plan of moe_permute: for the valid entries (0 <= ids[t, j] < num_experts) of
// ids [T, k] int32 (rows of any stride), writes tokens_per_expert [num_experts] and src[0, M)
// (flat indices t*k + j grouped by expert ascending, ascending within an expert; src int32
// [T * k]) and returns M. Entries outside [0, num_experts) are dropped.
int64_t moe_permute_plan(const View& tokens_per_expert, const View& src, const RowsIn& ids);

// x_perm [M, D] (contiguous): x_perm[r, :] = x[src[r] / k, :], x [T, D] of any element type
// (rows of any stride), src int32 with at least M entries, each in [0, T * k).
void moe_permute_gather(const View& x_perm, const RowsIn& x, const DenseIn& src, int64_t k, int num_threads);

// out [T, D] (contiguous, y's dtype): out[t, :] = sum over rows r with src[r] / k == t of
// weights[t, src[r] % k] * y[r, :], in float32 (rows of one slot in row order, slots in j
// order); tokens without rows get 0. y [M, D] (rows of any stride), src int32 [M], weights
// float32 [T, k] contiguous. Every src must lie in [0, T * k).
void moe_unpermute(const View& out, const RowsIn& y, const DenseIn& src, const DenseIn& weights, int num_threads);

}  // namespace glm5
