// GEMMs on the checkpoints' quantized formats (OPS.md section 3.1) and the bfloat16 grouped
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

#include <cstdint>

#include "core.h"

namespace glm5 {

// A matrix operand [rows, cols] with a unit stride along cols and its scales (contiguous;
// their shape depends on the op, see above; null for bfloat16).
struct GemmOperand {
  const void* data;
  DType dtype;
  int64_t rows, cols, row_stride;  // strides in elements
  const float* scale;
};

// The weights of E experts [E, N, K] (E = 1 for the dense ops) and their scales, contiguous
// [E, ...] with the per-expert shape of the dense op.
struct GemmWeights {
  const void* data;
  DType dtype;
  int64_t experts, rows, cols, expert_stride, row_stride;  // strides in elements
  const float* scale;
};

// The output [M, N] in out dtype (F32, F16 or BF16), row stride in elements.
struct GemmOutput {
  void* data;
  DType dtype;
  int64_t row_stride;
};

void fp8_block_gemm(const GemmOutput& out, const GemmOperand& a, const GemmWeights& w, int num_threads);
// tokens_per_expert[E]: counts >= 0 summing to a.rows (validated here: InvalidInput otherwise).
void fp8_grouped_gemm(const GemmOutput& out, const GemmOperand& a, const GemmWeights& w,
                      const int32_t* tokens_per_expert, int num_threads);
// bias: [N] float32 or null. K <= 131071 (so no int32 sum can overflow).
void int8_gemm(const GemmOutput& out, const GemmOperand& x, const GemmWeights& w, const float* bias,
               int num_threads);
void int8_grouped_gemm(const GemmOutput& out, const GemmOperand& x, const GemmWeights& w,
                       const int32_t* tokens_per_expert, int num_threads);
// The bfloat16 grouped_gemm: x [M, K] and w [E, N, K] bfloat16, out bfloat16.
void bf16_grouped_gemm(const GemmOutput& out, const GemmOperand& x, const GemmWeights& w,
                       const int32_t* tokens_per_expert, int num_threads);

// Tile-kernel tiers in use for the float (bfloat16 / FP8) and int8 paths: 0 portable, 1 AVX2,
// 2 AVX2 + AVX-VNNI, 3 AVX-512 (BF16 / VNNI), 4 AMX; a path without a tier's instructions
// uses the best lower one.
int qgemm_float_isa();
int qgemm_int8_isa();
int qgemm_max_isa();
int qgemm_set_isa_limit(int limit);  // caps both paths (tests); returns the previous cap

}  // namespace glm5
