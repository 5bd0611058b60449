#include "common_ops.h"

#include <cmath>
#include <vector>

namespace glm5 {

namespace {

template <DType XD, DType WD>
void rms_norm_impl(void* out_v, const void* x_v, const void* w_v, int64_t rows, int64_t dim,
                   int64_t xs, int64_t os, float eps, int nthreads) {
  using XT = typename Storage<XD>::type;
  using WT = typename Storage<WD>::type;
  const XT* x = static_cast<const XT*>(x_v);
  const WT* w = static_cast<const WT*>(w_v);
  XT* out = static_cast<XT*>(out_v);
  std::vector<float> wf(static_cast<size_t>(dim));
  for (int64_t i = 0; i < dim; ++i) wf[i] = load<WD>(w, i);
  const float* wp = wf.data();
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * dim > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const XT* xr = x + r * xs;
    XT* orow = out + r * os;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < dim; ++i) {
      const float v = load<XD>(xr, i);
      acc += v * v;
    }
    const float inv = 1.0f / std::sqrt(acc / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) store<XD>(orow, i, load<XD>(xr, i) * inv * wp[i]);
  }
}

}  // namespace

void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t dim,
              int64_t x_row_stride, int64_t out_row_stride, float eps, DType x_dtype,
              DType weight_dtype, int num_threads) {
  require(rows >= 0, "rms_norm", "x", "rows >= 0", std::to_string(rows));
  require(dim >= 1, "rms_norm", "x", "a last dim >= 1", std::to_string(dim));
  require(x_row_stride >= dim && out_row_stride >= dim, "rms_norm", "x",
          "row strides >= dim", std::to_string(x_row_stride) + "/" + std::to_string(out_row_stride));
  const int nt = clamp_threads(num_threads);
  dispatch_float(x_dtype, "rms_norm", "x", [&](auto xt) {
    dispatch_float(weight_dtype, "rms_norm", "weight", [&](auto wt) {
      rms_norm_impl<decltype(xt)::value, decltype(wt)::value>(out, x, weight, rows, dim, x_row_stride, out_row_stride, eps, nt);
    });
  });
}

}  // namespace glm5
