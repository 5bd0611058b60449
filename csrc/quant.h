// Quantization (OPS.md section 3).
#pragma once

#include "core.h"

namespace glm5 {

constexpr float kFp8Max = 448.0f;
constexpr float kFp8MinAmax = 1e-4f;

// The FP8 block scale of a block whose max |x| is amax: max(amax, 1e-4) / 448, rounded up to
// a power of two with ue8m0 (the reference's float32 log2/ceil/exp2). nan stays nan.
float fp8_block_scale(float amax, bool ue8m0);

// q[r, :] (float8_e4m3fn codes) and scale[r, K / block] of x[rows, K] (row stride
// x_row_stride elements); q and scale contiguous. block divides K.
void fp8_block_quant(uint8_t* q, float* scale, const void* x, int64_t rows, int64_t cols, int64_t x_row_stride,
                     int64_t block, bool ue8m0, DType dtype, int num_threads);

}  // namespace glm5
