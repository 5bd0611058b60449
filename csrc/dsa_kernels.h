// Internal to the DSA kernels: the inner tile kernels, in a table with one implementation per
// instruction-set tier, selected at run time: portable C++ with vector extensions
// (dsa_kernels_generic.cpp), the same source compiled for AVX2 + FMA (dsa_kernels_avx2.cpp),
// AVX-512 and AVX-512 + BF16 intrinsics (dsa_kernels_avx512.cpp). The drivers in dsa.cpp do all validation;
// these only ever see in-bounds pointers.
//
// Column layout shared by the attention and the indexer: the score GEMM is computed as
// S^T[keys x columns] = K_rows . Q^T, where the columns are (query, head) pairs packed once
// per work item into Q^T and key rows are broadcast straight from the cache. Columns come in
// vectors of kLanes; one kernel call handles 1..kMaxVecs vectors (a "column group"), so
// the packed Q^T of a group stays in L1 while a tile of keys streams past.
#pragma once

#include <cstdint>

#include "core.h"

// The AVX-512 tiers exist on x86-64 with GCC/Clang target attributes. Defining
// GLM5_HAL_PORTABLE_ONLY builds what every other architecture gets (checked in CI-less setups
// by building the native tests with -DGLM5_HAL_PORTABLE_ONLY).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(GLM5_HAL_PORTABLE_ONLY)
#define GLM5_DSA_X86 1
#else
#define GLM5_DSA_X86 0
#endif

namespace glm5::dsa {

constexpr int kLanes = 16;     // columns per vector (one zmm of fp32)
constexpr int kMaxVecs = 4;    // vectors per column group: 64 columns
constexpr int kTile = 64;      // keys per tile
constexpr int kDvBlock = 32;   // value dims per block of the paired output layout

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Kernels {
  int isa;  // tier: 0 portable, 1 AVX2 + FMA, 2 AVX-512F/BW, 3 AVX-512 + BF16

  // s[k * ncols + c] = sum_d qt[d * ncols + c] * rows[k][d] for k < nkeys, c < ncols,
  // ncols = nvec * kLanes, 1 <= nvec <= kMaxVecs. fp32 rows.
  void (*qk_f32)(const float* qt, int nvec, const float* const* rows, int nkeys, int64_t dim, float* s);

  // As qk_f32 for bfloat16 rows and q packed as bfloat16 pairs: qp[p * ncols + c] holds
  // q[c][2p] in its low and q[c][2p + 1] in its high half (0 past dim). Null below tier 3.
  void (*qk_bf16)(const uint32_t* qp, int nvec, const uint16_t* const* rows, int nkeys, int64_t dim,
                  float* s);

  // One online-softmax step over a tile of scores s[nkeys][ncols] (ncols % kLanes == 0):
  // z = scale * s; m_new = max(m, max_k z); alpha = exp(m - m_new) (0 while m is -inf);
  // s <- exp(z - m_new); l <- l * alpha + sum_k s; m <- m_new.
  void (*softmax_tile)(float* s, int nkeys, int ncols, float scale, float* m, float* l, float* alpha);

  // o[h][:] <- o[h][:] * alpha[h] + sum_k p[k * ncols + h] * rows[k][0:dv] for h < ncols
  // (a multiple of 4). fp32 rows; o rows are o_stride floats (>= round_up(dv, kDvBlock)).
  void (*pv_f32)(const float* p, int ncols, const float* const* rows, int nkeys, int64_t dv, float* o,
                 int64_t o_stride, const float* alpha);

  // As pv_f32 for bfloat16 rows, with o in the paired layout: within each block of kDvBlock
  // dims, the 16 even dims come first, then the 16 odd dims. Null below tier 2.
  void (*pv_bf16)(const float* p, int ncols, const uint16_t* const* rows, int nkeys, int64_t dv, float* o,
                  int64_t o_stride, const float* alpha);

  // Indexer epilogue. For each key k and vector v: x = s[k][v] (* key_scale[k] when given),
  // relu, times w[v * kLanes + lane] on the first vec_lanes[v] lanes; the lanes of all
  // vectors of one output slot are summed and added to out[vec_slot[v]][k].
  void (*indexer_reduce)(const float* s, int nkeys, int nvec, const int* vec_slot, const int* vec_lanes,
                         const float* w, const float* key_scale, float* const* out);

  // dst[i] = float(src[i]) for a float source dtype (F32, F16, BF16) or F8E4M3.
  void (*to_f32)(DType dtype, const void* src, int64_t n, float* dst);

  // dst[i] = bfloat16(src[i]) for F8E4M3 (exact).
  void (*fp8_to_bf16)(const uint8_t* src, int64_t n, uint16_t* dst);
};

const Kernels& generic_kernels();
#if GLM5_DSA_X86
// Null when the CPU lacks the tier.
const Kernels* avx2_kernels();
const Kernels* avx512_kernels();
const Kernels* avx512_bf16_kernels();
#endif

// The scalar members of the portable table, shared by the AVX2 table (they are a small
// part of the work next to QK and PV).
namespace scalar {
void indexer_reduce(const float* s, int nkeys, int nvec, const int* vec_slot, const int* vec_lanes, const float* w,
                    const float* key_scale, float* const* out);
void to_f32(DType dtype, const void* src, int64_t n, float* dst);
void fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst);
}  // namespace scalar

// e4m3fn -> float32 (exact): a 256-entry table. Its values are also exact in bfloat16.
const float* fp8_table();

}  // namespace glm5::dsa
