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

// Symmetric INT4 of w[rows, cols] (row stride w_row_stride elements), per group of `group`
// consecutive elements of a row: s = max(amax / 7, 1e-5), q = clamp(round_half_even(w / s), -7, 7)
// (a nan element gives q = 0 in its group; its scale is nan). Writes whichever outputs are given:
// fake[rows, cols] = q * s in `dtype` (contiguous); packed[rows, cols / 8] int32 with nibble
// q + 8 of element 8j + i in bits 4i..4i+3 of word j (cols % 8 == 0); scale[rows, cols / group].
void int4_quantize(void* fake, int32_t* packed, float* scale, const void* w, int64_t rows, int64_t cols,
                   int64_t w_row_stride, int64_t group, DType dtype, int num_threads);

// out[rows, 8 * words] float32 = (nibble - 8) * scale[r, col / group] of packed[rows, words]
// (row stride packed_row_stride words), scale[rows, 8 * words / group] contiguous.
void int4_unpack(float* out, const int32_t* packed, const float* scale, int64_t rows, int64_t words,
                 int64_t packed_row_stride, int64_t group, int num_threads);

// Dynamic symmetric per-row INT8 (OPS.md section 3.1) of x[rows, cols] (row stride x_row_stride
// elements): scale[r] = max |x[r, :]| / 127 and q[r, :] = clamp(round_half_even(x / scale),
// -127, 127) in float32; a row whose scale is 0 gets codes 0, a nan element code 0 (its row's
// scale is nan). q [rows, cols] and scale [rows] contiguous; cols >= 1.
void int8_quant(int8_t* q, float* scale, const void* x, int64_t rows, int64_t cols, int64_t x_row_stride,
                DType dtype, int num_threads);

}  // namespace glm5
