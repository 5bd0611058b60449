// GEMMs on the checkpoints' quantized formats (docs/ops/quant.md) and the bfloat16 grouped
// GEMM of the MoE layer (section 5): out[m, n] = sum_k a[m, k] w[n, k] (a linear layer's
// x @ w^T), per expert over expert-contiguous rows for the grouped forms.
//
// - FP8 (DeepSeek-V3 / GLM-5 checkpoints): a and w float8_e4m3fn; a_scale [M, K/128] per token
//   and 128 columns, w_scale [ceil(N/128), K/128] per 128 x 128 block. Each 128-K block's dot
//   product of the raw e4m3 values (exact in bfloat16, products exact in float32) is summed in
//   float32 and multiplied by a_scale * w_scale before it joins the float32 total.
// - INT8 W8A8: exact int32 dot products, then float(sum) * x_scale[m] * w_scale[n] (+ bias[n]).
// - bfloat16: float32 accumulation of exact products.
//
// Every size, stride and count is validated before anything is written (InvalidInput naming
// the op's argument). Inputs are read through row strides; the K dim must be contiguous.
#pragma once

#include "view.h"

namespace glm5 {

// Tensors (view.h): out [M, N] contiguous, its dtype (F32, F16 or BF16) the output dtype; the
// activations a / x [M, K] with rows of any stride; a dense weight [N, K] with rows of any
// stride, grouped weights [E, N, K] with a unit stride along K; scales, bias and counts
// contiguous. FP8: a_scale [M, K / 128], w_scale [ceil(N / 128), K / 128] (grouped: [E, ...]).
// INT8: x_scale [M], w_scale [N] (grouped: [E, N]), bias [N] float32 or null.
// tokens_per_expert [E] int32: counts >= 0 summing to M.
void fp8_block_gemm(const View& out, const RowsIn& a, const DenseIn& a_scale, const RowsIn& w,
                    const DenseIn& w_scale, int num_threads);
void fp8_grouped_gemm(const View& out, const RowsIn& a, const DenseIn& a_scale, const UnitLastIn& w,
                      const DenseIn& w_scale, const DenseIn& tokens_per_expert, int num_threads);
// K <= 131071 (so no int32 sum can overflow).
void int8_gemm(const View& out, const RowsIn& x, const DenseIn& x_scale, const RowsIn& w, const DenseIn& w_scale,
               const DenseIn* bias, int num_threads);
void int8_grouped_gemm(const View& out, const RowsIn& x, const DenseIn& x_scale, const UnitLastIn& w,
                       const DenseIn& w_scale, const DenseIn& tokens_per_expert, int num_threads);
// The bfloat16 grouped_gemm: x [M, K] and w [E, N, K] bfloat16, out bfloat16.
void bf16_grouped_gemm(const View& out, const RowsIn& x, const UnitLastIn& w, const DenseIn& tokens_per_expert,
                       int num_threads);

// Tile-kernel tiers in use for the float (bfloat16 / FP8) and int8 paths: 0 portable, 1 AVX2,
// 2 AVX2 + AVX-VNNI, 3 AVX-512 (BF16 / VNNI), 4 AMX; a path without a tier's instructions
// uses the best lower one.
int qgemm_float_isa();
int qgemm_int8_isa();
int qgemm_max_isa();
int qgemm_set_isa_limit(int limit);  // caps both paths (tests); returns the previous cap

}  // namespace glm5
