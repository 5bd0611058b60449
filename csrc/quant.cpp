#include "quant.h"

#include <cmath>
#include <vector>

#include "vec.h"

namespace glm5 {

float fp8_block_scale(float amax, bool ue8m0) {
  float s = (amax < kFp8MinAmax ? kFp8MinAmax : amax) / kFp8Max;  // nan: the comparison is false, nan stays
  if (ue8m0) s = std::exp2(std::ceil(std::log2(s)));
  return s;
}

void fp8_block_quant(uint8_t* q, float* scale, const void* x, int64_t rows, int64_t cols, int64_t x_row_stride,
                     int64_t block, bool ue8m0, DType dtype, int num_threads) {
  const char* op = "fp8_block_quant";
  require(rows >= 0 && cols >= 0, op, "x", "sizes >= 0", str(rows) + ", " + str(cols));
  require(block >= 1, op, "block", "an int >= 1", str(block));
  require(cols % block == 0, op, "block", "a divisor of K = " + str(cols), str(block));
  require(x_row_stride >= 0, op, "x", "a row stride >= 0", str(x_row_stride));
  require_float(dtype, op, "x");
  if (rows == 0 || cols == 0) return;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const int64_t blocks = cols / block;
  const char* xb = static_cast<const char*>(x);
  advise_fresh_output(q, rows * cols);
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

}  // namespace glm5
