// Elementwise / small ops (OPS.md section 2). Row-major views: rows `*_row_stride` elements
// apart, the last dim contiguous. Float dtypes: F32, F16, BF16; computation in float32.
#pragma once

#include "core.h"

namespace glm5 {

// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight, float32 accumulation.
void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t dim,
              int64_t x_row_stride, int64_t out_row_stride, float eps, DType x_dtype,
              DType weight_dtype, int num_threads);

// out[r, :n] = silu(x[r, :n]) * x[r, n:2n].
void silu_and_mul(void* out, const void* x, int64_t rows, int64_t n, int64_t x_row_stride,
                  int64_t out_row_stride, DType dtype, int num_threads);

// Rotary embedding of x[T, H, R] (element (t, h, i) at t * x_token_stride + h * x_head_stride + i)
// into out (same indexing with the out strides); positions[T] int32 or int64 (may be negative).
// Angles positions[t] * theta^(-2i/R) are computed in float64.
void apply_rope(void* out, const void* x, const void* positions, DType positions_dtype, int64_t tokens,
                int64_t heads, int64_t rot_dim, int64_t x_token_stride, int64_t x_head_stride,
                int64_t out_token_stride, int64_t out_head_stride, double theta, bool interleaved,
                DType dtype, int num_threads);

// out[r, :] = x[r, :] @ H_dim * scale (Sylvester Hadamard matrix), dim a power of two.
void hadamard_transform(void* out, const void* x, int64_t rows, int64_t dim, int64_t x_row_stride,
                        int64_t out_row_stride, float scale, DType dtype, int num_threads);

}  // namespace glm5
