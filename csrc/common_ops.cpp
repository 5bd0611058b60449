#include "common_ops.h"

#include <cmath>
#include <vector>

#include "vec.h"

namespace glm5 {

namespace {

void check_rows(const char* op, int64_t rows, int64_t dim, int64_t xs, int64_t os, int64_t out_width) {
  require(rows >= 0, op, "x", "rows >= 0", str(rows));
  require(dim >= 1, op, "x", "a last dim >= 1", str(dim));
  require(xs >= 0, op, "x", "a row stride >= 0", str(xs));
  require(rows <= 1 || os >= out_width, op, "out", "a row stride >= the row width " + str(out_width), str(os));
}

}  // namespace

void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t dim,
              int64_t x_row_stride, int64_t out_row_stride, float eps, DType x_dtype,
              DType weight_dtype, int num_threads) {
  const char* op = "rms_norm";
  check_rows(op, rows, dim, x_row_stride, out_row_stride, dim);
  require_float(x_dtype, op, "x");
  require_float(weight_dtype, op, "weight");
  require(eps >= 0.f && std::isfinite(eps), op, "eps", "a finite number >= 0", std::to_string(eps));
  if (rows == 0) return;
  const vec::Kernels& K = vec::kernels();
  std::vector<float> w(static_cast<size_t>(dim));
  K.load(weight_dtype, weight, dim, w.data());
  const int64_t xe = dtype_bytes(x_dtype);
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  advise_fresh_output(ob, rows * out_row_stride * xe);
  const int nt = threads_for(rows * dim, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(dim));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      K.load(x_dtype, xb + r * x_row_stride * xe, dim, buf.data());
      const float inv = 1.0f / std::sqrt(K.sum_squares(buf.data(), dim) / static_cast<float>(dim) + eps);
      K.scale_mul(buf.data(), w.data(), inv, dim);
      K.store(x_dtype, buf.data(), dim, ob + r * out_row_stride * xe);
    }
  }
}

void silu_and_mul(void* out, const void* x, int64_t rows, int64_t n, int64_t x_row_stride,
                  int64_t out_row_stride, DType dtype, int num_threads) {
  const char* op = "silu_and_mul";
  require(n >= 1, op, "x", "an even last dim >= 2", "half width " + str(n));
  check_rows(op, rows, 2 * n, x_row_stride, out_row_stride, n);
  require_float(dtype, op, "x");
  if (rows == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  advise_fresh_output(ob, rows * out_row_stride * es);
  const int nt = threads_for(rows * n, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(2 * n));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      K.load(dtype, xb + r * x_row_stride * es, 2 * n, buf.data());
      K.silu_mul(buf.data(), buf.data() + n, n);
      K.store(dtype, buf.data(), n, ob + r * out_row_stride * es);
    }
  }
}

void apply_rope(void* out, const void* x, const void* positions, DType positions_dtype, int64_t tokens,
                int64_t heads, int64_t rot_dim, int64_t x_token_stride, int64_t x_head_stride,
                int64_t out_token_stride, int64_t out_head_stride, double theta, bool interleaved,
                DType dtype, int num_threads) {
  const char* op = "apply_rope";
  require(tokens >= 0 && heads >= 0, op, "x", "sizes T, H >= 0", str(tokens) + ", " + str(heads));
  require(rot_dim >= 2 && rot_dim % 2 == 0, op, "x", "an even rotary dim R >= 2", str(rot_dim));
  require(x_token_stride >= 0 && x_head_stride >= 0, op, "x", "strides >= 0",
          str(x_token_stride) + ", " + str(x_head_stride));
  require(heads <= 1 || out_head_stride >= rot_dim, op, "out", "a head stride >= R", str(out_head_stride));
  require(tokens <= 1 || out_token_stride >= heads * rot_dim, op, "out", "a token stride >= H * R",
          str(out_token_stride));
  require(positions_dtype == DType::I32 || positions_dtype == DType::I64, op, "positions",
          "dtype int32 or int64", "dtype code " + str(static_cast<int>(positions_dtype)));
  require(theta > 0 && std::isfinite(theta), op, "theta", "a finite number > 0", std::to_string(theta));
  require_float(dtype, op, "x");
  if (tokens == 0 || heads == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t half = rot_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = std::pow(theta, static_cast<double>(i) * (-2.0 / static_cast<double>(rot_dim)));
  const int64_t es = dtype_bytes(dtype);
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  advise_fresh_output(ob, tokens * out_token_stride * es);
  const int nt = threads_for(tokens * heads * rot_dim, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(rot_dim)), cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const double pos = positions_dtype == DType::I32 ? static_cast<double>(static_cast<const int32_t*>(positions)[t])
                                                       : static_cast<double>(static_cast<const int64_t*>(positions)[t]);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos * inv_freq[i];
        cs[i] = static_cast<float>(std::cos(angle));
        sn[i] = static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < heads; ++h) {
        K.load(dtype, xb + (t * x_token_stride + h * x_head_stride) * es, rot_dim, buf.data());
        K.rope(buf.data(), cs.data(), sn.data(), half, interleaved);
        K.store(dtype, buf.data(), rot_dim, ob + (t * out_token_stride + h * out_head_stride) * es);
      }
    }
  }
}

void hadamard_transform(void* out, const void* x, int64_t rows, int64_t dim, int64_t x_row_stride,
                        int64_t out_row_stride, float scale, DType dtype, int num_threads) {
  const char* op = "hadamard_transform";
  check_rows(op, rows, dim, x_row_stride, out_row_stride, dim);
  require((dim & (dim - 1)) == 0, op, "x", "a last dim that is a power of two", str(dim));
  require(std::isfinite(scale), op, "scale", "a finite number", std::to_string(scale));
  require_float(dtype, op, "x");
  if (rows == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  advise_fresh_output(ob, rows * out_row_stride * es);
  const int nt = threads_for(rows * dim * 4, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(dim));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      K.load(dtype, xb + r * x_row_stride * es, dim, buf.data());
      K.fwht(buf.data(), dim, scale);
      K.store(dtype, buf.data(), dim, ob + r * out_row_stride * es);
    }
  }
}

}  // namespace glm5
