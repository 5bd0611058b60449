#include "common_ops.h"

#include <cmath>
#include <vector>

#include "vec.h"

namespace glm5 {

namespace {

// x and out as rows of equal count; out `out_width` wide with x's dtype, its rows apart by
// at least their width (rows of an input may overlap: a row stride of 0 reads an expanded
// tensor).
struct RowPair {
  Rows x, out;
};

RowPair row_pair(const char* op, const View& out, const View& x, int64_t out_width) {
  const Rows xr = rows_of(x, op, "x");
  const Rows orow = rows_of(out, op, "out");
  GLM5_REQUIRE(xr.cols >= 1, op, "x", "a last dim >= 1", str(xr.cols));
  GLM5_REQUIRE(xr.row_stride >= 0, op, "x", "a row stride >= 0", str(xr.row_stride));
  GLM5_REQUIRE(orow.rows == xr.rows && orow.cols == out_width, op, "out",
               str(xr.rows) + " rows of " + str(out_width), shape_str(out));
  GLM5_REQUIRE(orow.rows <= 1 || orow.row_stride >= out_width, op, "out",
               "a row stride >= the row width " + str(out_width), str(orow.row_stride));
  require_dtype_of(out, x, op, "out", "x");
  return {xr, orow};
}

}  // namespace

void rms_norm(const View& out, const RowsIn& x, const DenseIn& weight, float eps, int num_threads) {
  const char* op = "rms_norm";
  require_float(x.dtype, op, "x");
  const RowPair io = row_pair(op, out, x, x.ndim >= 1 ? x.size[x.ndim - 1] : 0);
  const int64_t rows = io.x.rows, dim = io.x.cols, x_row_stride = io.x.row_stride, out_row_stride = io.out.row_stride;
  require_float(weight.dtype, op, "weight");
  require_dense(weight, {dim}, op, "weight");
  const DType x_dtype = x.dtype, weight_dtype = weight.dtype;
  GLM5_REQUIRE(eps >= 0.f && std::isfinite(eps), op, "eps", "a finite number >= 0", std::to_string(eps));
  if (rows == 0) return;
  const vec::Kernels& K = vec::kernels();
  std::vector<float> w(static_cast<size_t>(dim));
  K.load(weight_dtype, weight.data, dim, w.data());
  const int64_t xe = dtype_bytes(x_dtype);
  const char* xb = static_cast<const char*>(io.x.data);
  char* ob = static_cast<char*>(io.out.data);
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

void silu_and_mul(const View& out, const RowsIn& x, int num_threads) {
  const char* op = "silu_and_mul";
  require_float(x.dtype, op, "x");
  const int64_t width = x.ndim >= 1 ? x.size[x.ndim - 1] : 0;
  GLM5_REQUIRE(width >= 2 && width % 2 == 0, op, "x", "an even last dim >= 2", str(width));
  const int64_t n = width / 2;
  const RowPair io = row_pair(op, out, x, n);
  const int64_t rows = io.x.rows, x_row_stride = io.x.row_stride, out_row_stride = io.out.row_stride;
  const DType dtype = x.dtype;
  if (rows == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const char* xb = static_cast<const char*>(io.x.data);
  char* ob = static_cast<char*>(io.out.data);
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

void apply_rope(const View& out, const UnitLastIn& x, const DenseIn& positions, double theta, bool interleaved,
                int num_threads) {
  const char* op = "apply_rope";
  require_float(x.dtype, op, "x");
  require_ndim(x, 3, op, "x");
  const int64_t tokens = x.size[0], heads = x.size[1], rot_dim = x.size[2];
  GLM5_REQUIRE(tokens >= 0 && heads >= 0, op, "x", "sizes T, H >= 0", str(tokens) + ", " + str(heads));
  GLM5_REQUIRE(rot_dim >= 2 && rot_dim % 2 == 0, op, "x", "an even rotary dim R >= 2", str(rot_dim));
  GLM5_REQUIRE(x.stride[2] == 1, op, "x", "a unit stride along the last dim", str(x.stride[2]));
  const int64_t x_token_stride = x.stride[0], x_head_stride = x.stride[1];
  GLM5_REQUIRE(x_token_stride >= 0 && x_head_stride >= 0, op, "x", "strides >= 0",
               str(x_token_stride) + ", " + str(x_head_stride));
  GLM5_REQUIRE(x.data != nullptr || tokens * heads == 0, op, "x", "a non-null data pointer", "null");
  require_ndim(out, 3, op, "out");
  GLM5_REQUIRE(out.size[0] == tokens && out.size[1] == heads && out.size[2] == rot_dim, op, "out",
               "shape " + shape_str(x) + " (that of 'x')", shape_str(out));
  require_dtype_of(out, x, op, "out", "x");
  GLM5_REQUIRE(out.stride[2] == 1, op, "out", "a unit stride along the last dim", str(out.stride[2]));
  const int64_t out_token_stride = out.stride[0], out_head_stride = out.stride[1];
  GLM5_REQUIRE(heads <= 1 || out_head_stride >= rot_dim, op, "out", "a head stride >= R", str(out_head_stride));
  GLM5_REQUIRE(tokens <= 1 || out_token_stride >= heads * rot_dim, op, "out", "a token stride >= H * R",
               str(out_token_stride));
  GLM5_REQUIRE(out.data != nullptr || tokens * heads == 0, op, "out", "a non-null data pointer", "null");
  const DType positions_dtype = positions.dtype;
  GLM5_REQUIRE(positions_dtype == DType::I32 || positions_dtype == DType::I64, op, "positions",
               "dtype int32 or int64", "dtype code " + str(static_cast<int>(positions_dtype)));
  require_dense(positions, {tokens}, op, "positions");
  GLM5_REQUIRE(theta > 0 && std::isfinite(theta), op, "theta", "a finite number > 0", std::to_string(theta));
  const DType dtype = x.dtype;
  if (tokens == 0 || heads == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t half = rot_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = std::pow(theta, static_cast<double>(i) * (-2.0 / static_cast<double>(rot_dim)));
  const int64_t es = dtype_bytes(dtype);
  const char* xb = static_cast<const char*>(x.data);
  char* ob = static_cast<char*>(out.data);
  const int nt = threads_for(tokens * heads * rot_dim, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(rot_dim)), cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const double pos = positions_dtype == DType::I32
                             ? static_cast<double>(static_cast<const int32_t*>(positions.data)[t])
                             : static_cast<double>(static_cast<const int64_t*>(positions.data)[t]);
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

void hadamard_transform(const View& out, const RowsIn& x, float scale, int num_threads) {
  const char* op = "hadamard_transform";
  require_float(x.dtype, op, "x");
  const RowPair io = row_pair(op, out, x, x.ndim >= 1 ? x.size[x.ndim - 1] : 0);
  const int64_t rows = io.x.rows, dim = io.x.cols, x_row_stride = io.x.row_stride, out_row_stride = io.out.row_stride;
  GLM5_REQUIRE((dim & (dim - 1)) == 0, op, "x", "a last dim that is a power of two", str(dim));
  GLM5_REQUIRE(std::isfinite(scale), op, "scale", "a finite number", std::to_string(scale));
  const DType dtype = x.dtype;
  if (rows == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const char* xb = static_cast<const char*>(io.x.data);
  char* ob = static_cast<char*>(io.out.data);
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
