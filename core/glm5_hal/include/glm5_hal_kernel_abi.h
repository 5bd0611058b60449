// The C interface glm5_hal's vendor kernel libraries share: dtype codes, status codes, and
// the paged sparse MLA decode entry point, implemented by
//   the CUDA-dialect kernels    backends/_cuda_dialect/src/sparse_mla_decode.cu (nvcc, mcc, hipcc)
//   the cambricon BANG C kernel backends/cambricon/csrc/sparse_mla_decode.mlu  (cncc)
//   the kunlun XPU C++ kernel   backends/kunlun/csrc/paged_kernels.xpu         (XTDK clang++)
// Each is a separate shared library loaded with ctypes; glm5_hal/kernel_library.py (dtype and
// status codes) and glm5_hal/vendor_ops/dsa.py (the decode arguments) mirror this header
// (tests/test_kernel_abi.py compares the mirror with what a C compiler lays out), and one
// launcher and one adapter (glm5_hal.vendor_ops.dsa) serve all three.
//
// Pointers are device addresses of contiguous tensors; `stream` is the vendor runtime's raw
// stream or queue handle (cudaStream_t, musaStream_t, hipStream_t, cnrtQueue_t, XPUStream).
// Indices read from device memory are range-checked before any dereference: an entry that
// is out of range is treated as invalid (skipped), never read through.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// dtype codes (glm5_hal.kernel_library.DTYPE_CODE)
enum {
  GLM5_HAL_F32 = 0,
  GLM5_HAL_F16 = 1,
  GLM5_HAL_BF16 = 2,
  GLM5_HAL_FP8_E4M3 = 3,
};

// What every entry point returns: OK; EINVAL when its host-side checks refuse the arguments
// (nothing is launched); otherwise the vendor runtime's (positive) error code of the launch.
enum { GLM5_HAL_OK = 0, GLM5_HAL_EINVAL = -22 };

// One call of the paged sparse MLA decode kernel.
typedef struct glm5_hal_sparse_mla_decode_args {
  // tensors
  const void* q;                 // [batch, queries_per_seq, heads, dqk]   dtype
  const void* kv_cache;          // [num_blocks, block_size, dqk]          dtype
  const int32_t* block_table;    // [batch, max_blocks]
  const int32_t* context_lens;   // [batch]
  const int32_t* indices;        // [batch, queries_per_seq, topk] logical positions
  void* out;                     // [batch, queries_per_seq, heads, d_v]   dtype, written
  float* lse;                    // [batch, queries_per_seq, heads]        written
  // shapes
  int64_t batch;
  int64_t queries_per_seq;
  int64_t heads;
  int64_t dqk;
  int64_t d_v;
  int64_t topk;
  int64_t num_blocks;
  int64_t block_size;
  int64_t max_blocks;
  // options
  float sm_scale;
  int32_t dtype;                 // GLM5_HAL_F32, GLM5_HAL_F16 or GLM5_HAL_BF16
} glm5_hal_sparse_mla_decode_args;

// Sparse MLA attention (absorbed / MQA mode, one latent KV head) over a paged cache
// (docs/ops/dsa.md, sparse_mla_decode_paged). A position p of sequence b is valid iff
// 0 <= p < context_lens[b] and its block id block_table[b, p / block_size] lies in
// [0, num_blocks); duplicates count once per occurrence. For each (b, i, h), over the valid
// positions j: z_j = sm_scale * q . row_j, out = softmax(z) @ row[:d_v], lse = logsumexp(z)
// (natural log), accumulated in float32; no valid position gives out 0 and lse -inf.
// sparse_mla_attention is the case batch = 1, num_blocks = 1, block_size = S.
// Each implementation states its size limits (glm5_hal.vendor_ops.dsa.DecodeLimits) and
// returns GLM5_HAL_EINVAL for sizes outside them.
int glm5_hal_sparse_mla_decode_paged(const glm5_hal_sparse_mla_decode_args* args, void* stream);

#ifdef __cplusplus
}
#endif
