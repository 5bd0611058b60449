// Elementwise / small ops (OPS.md section 2). Row-major 2-D views: `rows` rows of `dim`
// elements, rows `*_row_stride` elements apart, last dim contiguous.
#pragma once

#include "core.h"

namespace glm5 {

// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight, float32 accumulation.
void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t dim,
              int64_t x_row_stride, int64_t out_row_stride, float eps, DType x_dtype,
              DType weight_dtype, int num_threads);

}  // namespace glm5
