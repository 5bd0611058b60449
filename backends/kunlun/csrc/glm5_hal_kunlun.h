// The kunlun backend's own XPU C++ kernels (XTDK): the C entry points kernels.py loads with
// ctypes.
//
// Same convention as csrc/: raw device pointers, sizes, and the stream to launch on; no
// libtorch. Inputs are validated in Python (glm5_hal.ops + the adapter's supports()), but
// the kernels still check every index they dereference: an index outside the cache is
// skipped, never read. Built only with the XTDK toolchain (XTDK_PATH); not compiled here.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// dtype codes (kernels.py DTYPE_CODE)
enum { GLM5_XPU_F32 = 0, GLM5_XPU_F16 = 1, GLM5_XPU_BF16 = 2 };

// Sparse MLA decode over a paged latent cache: the contract of the cambricon backend's
// glm5_hal_mlu_sparse_mla_decode_paged (backends/cambricon/csrc/glm5_hal_cambricon.h),
// with `stream` an XPUStream. Requires dqk <= 1024, heads <= 128, dv <= dqk.
// Returns 0, or a nonzero XPU runtime error code.
int glm5_hal_xpu_sparse_mla_decode_paged(const void* q, const void* kv_cache, const int32_t* block_table,
                                         const int32_t* context_lens, const int32_t* indices, void* out,
                                         float* lse, int64_t batch, int64_t queries, int64_t heads,
                                         int64_t dqk, int64_t dv, int64_t topk, int64_t num_blocks,
                                         int64_t block_size, int64_t max_blocks, float sm_scale, int dtype,
                                         void* stream);

// kv_cache_gather (OPS.md 6): for each sequence b and position p < context_lens[b], copies
// cache row block_table[b, p / block_size] * block_size + p % block_size (row_bytes bytes)
// to out row out_offsets[b] + p. out_offsets is int64 [batch] (exclusive prefix sums of
// context_lens). A byte copy, so any element type (including FP8) works. Rows whose block id
// is outside [0, num_blocks) are skipped. Returns 0, or a nonzero XPU runtime error code.
int glm5_hal_xpu_kv_cache_gather(const void* cache, const int32_t* block_table, const int32_t* context_lens,
                                 const int64_t* out_offsets, void* out, int64_t batch, int64_t num_blocks,
                                 int64_t block_size, int64_t max_blocks, int64_t row_bytes, void* stream);

#ifdef __cplusplus
}
#endif
