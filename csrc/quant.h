// Quantization (docs/ops/quant.md).
#pragma once

#include "view.h"

namespace glm5 {

constexpr float kFp8Max = 448.0f;
constexpr float kFp8MinAmax = 1e-4f;

// The FP8 block scale of a block whose max |x| is amax: max(amax, 1e-4) / 448, rounded up to
// a power of two with ue8m0 (the reference's float32 log2/ceil/exp2). nan stays nan.
float fp8_block_scale(float amax, bool ue8m0);

// q (float8_e4m3fn codes) and scale (float32) of x [rows, K] (a float dtype; view.h rows):
// q [rows, K] and scale [rows, K / block], each contiguous with x's row count (any leading
// dims, e.g. x's own). block divides K.
void fp8_block_quant(const View& q, const View& scale, const RowsIn& x, int64_t block, bool ue8m0, int num_threads);

// Symmetric INT4 of w [rows, K] (a float dtype, rows of any stride), per group of `group`
// consecutive elements of a row: s = max(amax / 7, 1e-5), q = clamp(round_half_even(w / s), -7, 7)
// (a nan element gives q = 0 in its group; its scale is nan). Writes whichever outputs are
// given (null: not wanted; all contiguous): fake [rows, K] = q * s in w's dtype; packed
// [rows, K / 8] int32 with nibble q + 8 of element 8j + i in bits 4i..4i+3 of word j (K % 8 == 0);
// scale [rows, K / group] float32.
void int4_quantize(const View* fake, const View* packed, const View* scale, const RowsIn& w, int64_t group,
                   int num_threads);

// out [rows, 8 * words] float32 = (nibble - 8) * scale[r, col / group] of packed [rows, words]
// int32 (rows of any stride); scale [rows, 8 * words / group] float32; out and scale contiguous.
void int4_unpack(const View& out, const RowsIn& packed, const DenseIn& scale, int64_t group, int num_threads);

// Dynamic symmetric per-row INT8 (docs/ops/quant.md) of x [rows, K] (a float dtype; view.h
// rows, K >= 1): scale[r] = max |x[r, :]| / 127 and q[r, :] = clamp(round_half_even(x / scale),
// -127, 127) in float32; a row whose scale is 0 gets codes 0, a nan element code 0 (its row's
// scale is nan). q [rows, K] int8 and scale (rows elements) float32, contiguous (any leading dims).
void int8_quant(const View& q, const View& scale, const RowsIn& x, int num_threads);

}  // namespace glm5
