#include "quant.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "vec.h"

namespace glm5 {

float fp8_block_scale(float amax, bool ue8m0) {
  float s = (amax < kFp8MinAmax ? kFp8MinAmax : amax) / kFp8Max;  // nan: the comparison is false, nan stays
  if (ue8m0) s = std::exp2(std::ceil(std::log2(s)));
  return s;
}

namespace {

// An output of `rows` rows of `cols` (a contiguous tensor of any leading dims) and dtype d.
void require_rows_out(const View& v, int64_t rows, int64_t cols, DType d, const char* op, const char* arg) {
  require_dtype(v, d, op, arg);
  require_contiguous(v, op, arg);
  const Rows r = rows_of(v, op, arg);
  GLM5_REQUIRE(r.rows == rows && r.cols == cols, op, arg, str(rows) + " rows of " + str(cols), "shape " + shape_str(v));
}

}  // namespace

void fp8_block_quant(const View& q_out, const View& scale_out, const RowsIn& x, int64_t block, bool ue8m0,
                     int num_threads) {
  const char* op = "fp8_block_quant";
  const Rows xr = rows_of(x, op, "x");
  const int64_t rows = xr.rows, cols = xr.cols, x_row_stride = xr.row_stride;
  GLM5_REQUIRE(block >= 1, op, "block", "an int >= 1", str(block));
  GLM5_REQUIRE(cols % block == 0, op, "block", "a divisor of K = " + str(cols), str(block));
  GLM5_REQUIRE(x_row_stride >= 0, op, "x", "a row stride >= 0", str(x_row_stride));
  require_float(x.dtype, op, "x");
  require_rows_out(q_out, rows, cols, DType::F8E4M3, op, "q");
  require_rows_out(scale_out, rows, cols / block, DType::F32, op, "scale");
  const DType dtype = x.dtype;
  uint8_t* q = static_cast<uint8_t*>(q_out.data);
  float* scale = static_cast<float*>(scale_out.data);
  if (rows == 0 || cols == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const int64_t blocks = cols / block;
  const char* xb = static_cast<const char*>(xr.data);
  const int nt = threads_for(rows * cols * 4, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      K.load(dtype, xb + r * x_row_stride * es, cols, buf.data());
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xs = buf.data() + b * block;
        const float s = fp8_block_scale(K.abs_max(xs, block), ue8m0);
        scale[r * blocks + b] = s;
        K.fp8_encode(xs, s, block, q + r * cols + b * block);
      }
    }
  }
}

namespace {

constexpr float kInt4Max = 7.0f;
constexpr float kInt4MinScale = 1e-5f;

// round half to even for |v| < 2^22 (adding and removing 1.5 * 2^23 leaves the rounded value);
// then clamp to [-7, 7]; nan -> 0 (a defined value instead of an undefined conversion).
inline int32_t int4_level(float v) {
  float r = (v + 12582912.0f) - 12582912.0f;
  r = r < -kInt4Max ? -kInt4Max : r;
  r = r > kInt4Max ? kInt4Max : r;
  return r == r ? static_cast<int32_t>(r) : 0;
}

}  // namespace

void int4_quantize(const View* fake_out, const View* packed_out, const View* scale_out, const RowsIn& w, int64_t group,
                   int num_threads) {
  const char* op = packed_out ? "int4_pack" : "int4_fake_quant";
  require_ndim(w, 2, op, "w");
  const Rows wr = rows_of(w, op, "w");
  const int64_t rows = wr.rows, cols = wr.cols, w_row_stride = wr.row_stride;
  GLM5_REQUIRE(group >= 1, op, "group_size", "an int >= 1", str(group));
  GLM5_REQUIRE(cols % group == 0, op, "group_size", "a divisor of K = " + str(cols), str(group));
  GLM5_REQUIRE(!packed_out || cols % 8 == 0, op, "w", "a last dim K divisible by 8 (nibbles per int32 word)", str(cols));
  GLM5_REQUIRE(w_row_stride >= 0, op, "w", "a row stride >= 0", str(w_row_stride));
  require_float(w.dtype, op, "w");
  if (rows == 0 || cols == 0) return;
  GLM5_REQUIRE(fake_out || packed_out || scale_out, op, "out", "at least one output", "none");
  if (fake_out) {
    require_dtype_of(*fake_out, w, op, "out", "w");
    require_dense(*fake_out, {rows, cols}, op, "out");
  }
  if (packed_out) {
    require_dtype(*packed_out, DType::I32, op, "packed");
    require_dense(*packed_out, {rows, cols / 8}, op, "packed");
  }
  if (scale_out) {
    require_dtype(*scale_out, DType::F32, op, "scale");
    require_dense(*scale_out, {rows, cols / group}, op, "scale");
  }
  const DType dtype = w.dtype;
  int32_t* packed = packed_out ? static_cast<int32_t*>(packed_out->data) : nullptr;
  float* scale = scale_out ? static_cast<float*>(scale_out->data) : nullptr;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const int64_t groups = cols / group;
  const char* wb = static_cast<const char*>(wr.data);
  char* fb = fake_out ? static_cast<char*>(fake_out->data) : nullptr;
  const int nt = threads_for(rows * cols * 4, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(cols));
    std::vector<int32_t> q(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      K.load(dtype, wb + r * w_row_stride * es, cols, buf.data());
      for (int64_t g = 0; g < groups; ++g) {
        float* x = buf.data() + g * group;
        int32_t* qg = q.data() + g * group;
        float s = K.abs_max(x, group) / kInt4Max;
        s = s < kInt4MinScale ? kInt4MinScale : s;  // nan stays nan, as torch's clamp_min
        if (scale) scale[r * groups + g] = s;
        for (int64_t i = 0; i < group; ++i) qg[i] = int4_level(x[i] / s);
        if (fb) {
          for (int64_t i = 0; i < group; ++i) x[i] = static_cast<float>(qg[i]) * s;
        }
      }
      if (fb) K.store(dtype, buf.data(), cols, fb + r * cols * es);
      if (packed) {
        int32_t* words = packed + r * (cols / 8);
        for (int64_t j = 0; j < cols / 8; ++j) {
          uint32_t word = 0;
          for (int i = 0; i < 8; ++i) word |= static_cast<uint32_t>(q[8 * j + i] + 8) << (4 * i);
          words[j] = static_cast<int32_t>(word);
        }
      }
    }
  }
}

void int4_unpack(const View& out_view, const RowsIn& packed_view, const DenseIn& scale_view, int64_t group,
                 int num_threads) {
  const char* op = "int4_unpack";
  require_dtype(packed_view, DType::I32, op, "packed");
  require_ndim(packed_view, 2, op, "packed");
  const Rows pk = rows_of(packed_view, op, "packed");
  const int64_t rows = pk.rows, words = pk.cols, packed_row_stride = pk.row_stride;
  GLM5_REQUIRE(group >= 1, op, "group_size", "an int >= 1", str(group));
  const int64_t cols = 8 * words;
  GLM5_REQUIRE(cols % group == 0, op, "group_size", "a divisor of K = " + str(cols) + " (8 * packed.shape[1])", str(group));
  GLM5_REQUIRE(packed_row_stride >= 0, op, "packed", "a row stride >= 0", str(packed_row_stride));
  require_dtype(scale_view, DType::F32, op, "scale");
  require_dense(scale_view, {rows, cols / group}, op, "scale");
  require_dtype(out_view, DType::F32, op, "out");
  require_dense(out_view, {rows, cols}, op, "out");
  const int32_t* packed = static_cast<const int32_t*>(pk.data);
  const float* scale = static_cast<const float*>(scale_view.data);
  float* out = static_cast<float*>(out_view.data);
  if (rows == 0 || cols == 0) return;
  const int64_t groups = cols / group;
  const int nt = threads_for(rows * cols * 2, num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* pw = reinterpret_cast<const uint32_t*>(packed + r * packed_row_stride);
    const float* sr = scale + r * groups;
    float* o = out + r * cols;
    if (group % 8 == 0) {  // one scale per word
      for (int64_t j = 0; j < words; ++j) {
        const uint32_t word = pw[j];
        const float s = sr[(8 * j) / group];
        for (int i = 0; i < 8; ++i) o[8 * j + i] = static_cast<float>(static_cast<int32_t>((word >> (4 * i)) & 0xfu) - 8) * s;
      }
    } else {
      for (int64_t c = 0; c < cols; ++c)
        o[c] = static_cast<float>(static_cast<int32_t>((pw[c >> 3] >> (4 * (c & 7))) & 0xfu) - 8) * sr[c / group];
    }
  }
}

void int8_quant(const View& q_out, const View& scale_out, const RowsIn& x, int num_threads) {
  const char* op = "int8_quant";
  const Rows xr = rows_of(x, op, "x");
  const int64_t rows = xr.rows, cols = xr.cols;
  GLM5_REQUIRE(cols >= 1, op, "x", "a last dim K >= 1 (a row to take the maximum of)", str(cols));
  GLM5_REQUIRE(xr.row_stride >= 0, op, "x", "a row stride >= 0", str(xr.row_stride));
  require_float(x.dtype, op, "x");
  require_rows_out(q_out, rows, cols, DType::I8, op, "q");
  require_dtype(scale_out, DType::F32, op, "scale");
  require_contiguous(scale_out, op, "scale");
  GLM5_REQUIRE(scale_out.numel() == rows, op, "scale", str(rows) + " elements", "shape " + shape_str(scale_out));
  if (rows == 0) return;
  int8_t* q = static_cast<int8_t*>(q_out.data);
  float* scale = static_cast<float*>(scale_out.data);
  const vec::Kernels& K = vec::kernels();
  const DType dtype = x.dtype;
  const int64_t es = dtype_bytes(dtype);
  const char* xb = static_cast<const char*>(xr.data);
  const int nt = threads_for(rows * cols * 4, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      K.load(dtype, xb + r * xr.row_stride * es, cols, buf.data());
      const float s = K.abs_max(buf.data(), cols) / 127.0f;
      scale[r] = s;
      if (s == 0.0f) std::memset(q + r * cols, 0, static_cast<size_t>(cols));
      else K.int8_encode(buf.data(), s, cols, q + r * cols);
    }
  }
}

}  // namespace glm5
