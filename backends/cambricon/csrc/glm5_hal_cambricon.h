// The cambricon backend's own BANG C kernels: the C entry points kernels.py loads with ctypes.
//
// Same convention as csrc/: raw device pointers, sizes, and the queue to launch on; no
// libtorch. Inputs are validated in Python (glm5_hal.ops + the adapter's supports()), but
// the kernels still check every index they dereference: an index outside the cache is
// skipped, never read. Built only with Cambricon's Neuware SDK (cncc); not compiled here.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// dtype codes (kernels.py DTYPE_CODE)
enum { GLM5_MLU_F32 = 0, GLM5_MLU_F16 = 1, GLM5_MLU_BF16 = 2 };

// Sparse MLA decode over a paged latent cache (OPS.md 4.2, sparse_mla_decode_paged).
//   q            [batch, queries, heads, dqk]            dtype
//   kv_cache     [num_blocks, block_size, dqk]           dtype
//   block_table  [batch, max_blocks] int32
//   context_lens [batch] int32
//   indices      [batch, queries, topk] int32 logical positions; p is valid iff
//                0 <= p < context_lens[b] (and its block id lies in [0, num_blocks)),
//                others are ignored; duplicates count once per occurrence
//   out          [batch, queries, heads, dv]             dtype  (written)
//   lse          [batch, queries, heads] float32                (written)
// For each (b, i, h): z_j = sm_scale * q . row_j over the valid j, out = softmax(z) @
// row[:dv], lse = logsumexp(z) (natural log); no valid j: out = 0, lse = -inf. All tensors
// contiguous. Accumulation in float32. Requires dqk <= 1024, heads <= 128, dv <= dqk.
// Returns 0, or the CNRT error code of the launch. `queue` is a cnrtQueue_t.
int glm5_hal_mlu_sparse_mla_decode_paged(const void* q, const void* kv_cache, const int32_t* block_table,
                                         const int32_t* context_lens, const int32_t* indices, void* out,
                                         float* lse, int64_t batch, int64_t queries, int64_t heads,
                                         int64_t dqk, int64_t dv, int64_t topk, int64_t num_blocks,
                                         int64_t block_size, int64_t max_blocks, float sm_scale, int dtype,
                                         void* queue);

#ifdef __cplusplus
}
#endif
