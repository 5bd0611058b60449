// Internal to the quantized GEMMs (qgemm.cpp): the tile kernels, one table per instruction-set
// tier, chosen at run time like the other kernel families. The driver does all validation and
// all layout work; a tile kernel only ever sees in-bounds, padded operands:
//
// - A: `mr` rows (the tier's row tile) of a row-major scratch copy, zero-padded to whole row
//   tiles per expert and along K to whole K steps (float path: bfloat16 values, FP8 converted
//   exactly; int8 path: int8 values, or int8 + 128 as unsigned bytes on tiers that multiply
//   unsigned by signed bytes).
// - B: one packed panel of `kNr` = 32 weight rows (output columns) over a K range, in the
//   "VNNI" order the dot-product instructions and AMX tiles read: float path [kc/2][32][2]
//   bfloat16 (K pairs of 32 columns), int8 path [kc/4][32][4] (K quads of 32 columns).
//   32 columns divide the 128-column FP8 weight block, so a panel has one weight scale per
//   128-K block.
// - C: an mr x 32 tile of a float32 (int32) accumulation buffer, row stride ldc.
#pragma once

#include <cstdint>

#include "core.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(GLM5_HAL_PORTABLE_ONLY)
#define GLM5_QGEMM_X86 1
#else
#define GLM5_QGEMM_X86 0
#endif

namespace glm5::qgemm {

constexpr int kNr = 32;            // columns per packed weight panel
constexpr int kScaleBlock = 128;   // FP8 block (activations 1 x 128, weights 128 x 128)
constexpr int kFloatKStep = 32;    // K granularity of the float path (an AMX bf16 tile row)
constexpr int kIntKStep = 64;      // K granularity of the int8 path (an AMX int8 tile row)

// Tiers, shared by both families: a family without its instructions at a tier falls back to
// the best lower tier it has.
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512 = 3, kAmx = 4 };

// FP8 block scales of one tile call: the sum over 128-K block b of C[r][c] is multiplied by
// row[r * row_stride + b] * col[b * col_block_stride + c * col_stride] before it is added, in
// float32. col_stride is 0 (one column scale per block for the whole panel) or 1.
struct BlockScales {
  const float* row;
  int64_t row_stride;
  const float* col;
  int64_t col_block_stride;
  int64_t col_stride;
};

// One panel of 32 columns packed from rows n0..n0+32 of w (row stride w_stride elements; rows
// >= n are zero) over the K range [k0, k0 + kc) (elements >= k are zero): float path from
// bfloat16 or FP8 (converted exactly), int8 path with col_sum[c] += the packed column's sum
// (when col_sum is given).
using PackFloat = void (*)(const void* w, DType wd, int64_t w_stride, int64_t n, int64_t k, int64_t n0, int64_t k0,
                           int64_t kc, uint16_t* panel);
using PackInt8 = void (*)(const int8_t* w, int64_t w_stride, int64_t n, int64_t k, int64_t n0, int64_t k0,
                          int64_t kc, int8_t* panel, int32_t* col_sum);

struct FloatTile {
  int isa;
  int mr;   // rows per tile call
  PackFloat pack;
  // dst[i] = the bfloat16 bits of e4m3fn src[i] (exact)
  void (*fp8_to_bf16)(const uint8_t* src, int64_t n, uint16_t* dst);
  // Called by each thread before its first and after its last tile call of a task (AMX loads
  // its tile configuration and releases the tile state); null when nothing is needed.
  void (*begin)();
  void (*end)();
  // C[r][c] = (accumulate ? C[r][c] : 0) + sum_k A[r][k] * B[k][c] for r < mr, c < 32, over
  // k < kc (a multiple of kFloatKStep), A bf16 rows of stride lda elements, B one packed panel.
  // With scales (FP8; kc a multiple of 128), each 128-K block's sums are scaled (BlockScales).
  void (*tile)(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* c, int64_t ldc,
               bool accumulate, const BlockScales* scales);
  // The bfloat16 grouped GEMM without packing, where the tier has it (null elsewhere): both
  // operands read in place, K contiguous, any m, n, k >= 0 (no padding):
  // C[i][j] = sum_{k' < k} x[i][k'] * w[j][k'] in float32 for i < m, j < n (C row stride ldc).
  void (*dot_rows)(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* w, int64_t ldw, int64_t n, int64_t k,
                   float* c, int64_t ldc);
};

struct Int8Tile {
  int isa;
  int mr;
  PackInt8 pack;
  void (*begin)();
  void (*end)();
  bool biased_a;  // A holds x + 128 as unsigned bytes: the sums carry 128 * (sum of B's column)
  // C[r][c] = (accumulate ? C[r][c] : 0) + sum_k A[r][k] * B[k][c] in int32 (wrapping), k < kc
  // (a multiple of kIntKStep).
  void (*tile)(const int8_t* a, int64_t lda, const int8_t* b, int64_t kc, int32_t* c, int64_t ldc,
               bool accumulate);
};

const FloatTile& portable_float_tile();
const Int8Tile& portable_int8_tile();
#if GLM5_QGEMM_X86
// Null when the CPU lacks the tier's instructions.
const FloatTile* avx2_float_tile();
const Int8Tile* avx2_int8_tile();      // AVX2 multiply-add of sign-extended 16-bit pairs
const Int8Tile* avx_vnni_int8_tile();  // AVX-VNNI vpdpbusd (256-bit)
const FloatTile* avx512_float_tile();  // AVX-512 BF16 vdpbf16ps
const Int8Tile* avx512_int8_tile();    // AVX-512 VNNI vpdpbusd
const FloatTile* amx_float_tile();     // AMX-BF16 tiles
const Int8Tile* amx_int8_tile();       // AMX-INT8 tiles
// AMX needs the kernel's permission for its tile state (Linux: arch_prctl), once per process,
// and a tile configuration per thread; the AMX tables call these themselves.
bool amx_usable();
#endif

// Portable packing and conversion (the portable and AVX2 tiers').
void pack_float_panel(const void* w, DType wd, int64_t w_stride, int64_t n, int64_t k, int64_t n0, int64_t k0,
                      int64_t kc, uint16_t* panel);
void pack_int8_panel(const int8_t* w, int64_t w_stride, int64_t n, int64_t k, int64_t n0, int64_t k0, int64_t kc,
                     int8_t* panel, int32_t* col_sum);
void fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst);
#if GLM5_QGEMM_X86
// AVX-512 (F, BW) packing and conversion, shared by the AVX-512 and AMX tiers.
void avx512_pack_float_panel(const void* w, DType wd, int64_t w_stride, int64_t n, int64_t k, int64_t n0,
                             int64_t k0, int64_t kc, uint16_t* panel);
void avx512_pack_int8_panel(const int8_t* w, int64_t w_stride, int64_t n, int64_t k, int64_t n0, int64_t k0,
                            int64_t kc, int8_t* panel, int32_t* col_sum);
void avx512_fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst);
#endif

// e4m3fn -> bfloat16 bits, exact (every e4m3 value is a bfloat16 value), nan kept.
const uint16_t* fp8_bf16_table();

}  // namespace glm5::qgemm
