// Elementwise / small ops (docs/ops/common.md). Float dtypes: F32, F16, BF16; computation in
// float32. Row ops read their input as rows (view.h: rows_of, any layout whose leading dims
// merge) and write rows of the same shape and dtype.
#pragma once

#include "view.h"

namespace glm5 {

// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight, float32 accumulation.
// weight [D] contiguous, any float dtype.
void rms_norm(const View& out, const RowsIn& x, const DenseIn& weight, float eps, int num_threads);

// out[r, :n] = silu(x[r, :n]) * x[r, n:2n]; x [R, 2n], out [R, n].
void silu_and_mul(const View& out, const RowsIn& x, int num_threads);

// Rotary embedding of x [T, H, R] (any token and head strides, unit last stride) into out
// (same shape and dtype, its own strides); positions [T] int32 or int64 contiguous (may be
// negative). Angles positions[t] * theta^(-2i/R) are computed in float64.
void apply_rope(const View& out, const UnitLastIn& x, const DenseIn& positions, double theta, bool interleaved,
                int num_threads);

// out[r, :] = x[r, :] @ H_D * scale (Sylvester Hadamard matrix), D a power of two.
void hadamard_transform(const View& out, const RowsIn& x, float scale, int num_threads);

}  // namespace glm5
