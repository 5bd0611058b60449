// DeepSeek Sparse Attention kernels (OPS.md section 4): the lightning indexer (logits, fused
// score + top-k, paged top-k) and MLA attention in absorbed (MQA) mode over sparse indices,
// sparse paged decode and dense paged decode.
//
// Layouts: q, weights, indices and the outputs are dense row-major; key/KV sources carry
// their own strides (in elements; the last dim is always contiguous) so caches are read in
// place. Every index the kernels dereference (key ranges, context lengths, block ids) is
// validated before anything is written; violations raise glm5::InvalidInput. Indices the
// contract says are ignored (sparse attention entries outside the valid range) are skipped.
#pragma once

#include "core.h"

namespace glm5 {

// Key rows [rows, dim]: a float dtype, or F8E4M3 with a float32 scale per row.
struct DsaKeys {
  const void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0, dim = 0, row_stride = 0;
  const float* scale = nullptr;  // F8E4M3 only: scale[row * scale_stride]
  int64_t scale_stride = 0;
};

// A paged cache [num_blocks, block_size, dim] (+ F8E4M3 scale [num_blocks, block_size]).
struct DsaPagedCache {
  const void* data = nullptr;
  DType dtype = DType::F32;
  int64_t num_blocks = 0, block_size = 0, dim = 0, block_stride = 0, row_stride = 0;
  const float* scale = nullptr;
  int64_t scale_block_stride = 0, scale_row_stride = 0;
};

// block_table int32 [batch, max_blocks] (row stride in elements), context_lens int32 [batch].
struct DsaPaging {
  const int32_t* block_table = nullptr;
  int64_t batch = 0, max_blocks = 0, block_table_stride = 0;
  const int32_t* context_lens = nullptr;
};

// out[t, s] (row stride out_row_stride) = sum_h weights[t, h] * relu(q[t, h] . k[s]) for
// k_start[t] <= s < k_end[t], -inf elsewhere. q [tokens, heads, dim], weights [tokens, heads].
void indexer_logits(float* out, int64_t out_row_stride, const void* q, DType q_dtype, int64_t tokens,
                    int64_t heads, int64_t dim, const DsaKeys& k, const float* weights,
                    const int32_t* k_start, const int32_t* k_end, int num_threads);

// out [tokens, topk]: positions of the topk largest indexer logits of each row, left-packed,
// -1 padded. Fused: no [tokens, S] logits tensor is formed.
void indexer_topk(int32_t* out, int64_t topk, const void* q, DType q_dtype, int64_t tokens, int64_t heads,
                  int64_t dim, const DsaKeys& k, const float* weights, const int32_t* k_start,
                  const int32_t* k_end, int num_threads);

// out [batch, queries, topk]: logical positions; query i of sequence b sees
// [0, context_lens[b] - queries + i + 1). q [batch, queries, heads, dim], weights likewise
// without dim.
void indexer_topk_paged(int32_t* out, int64_t topk, const void* q, DType q_dtype, int64_t batch,
                        int64_t queries, int64_t heads, int64_t dim, const DsaPagedCache& k_cache,
                        const float* weights, const DsaPaging& paging, int num_threads);

// (out [tokens, heads, d_v] of q's dtype, lse float32 [tokens, heads]) over rows
// kv[indices[t, j]] for 0 <= indices[t, j] < kv_rows (others ignored, duplicates counted).
void sparse_mla_attention(void* out, float* lse, const void* q, DType q_dtype, int64_t tokens, int64_t heads,
                          int64_t dqk, const void* kv, int64_t kv_rows, int64_t kv_row_stride,
                          const int32_t* indices, int64_t topk, float sm_scale, int64_t d_v, int num_threads);

// q [batch, queries, heads, dqk]; indices [batch, queries, topk] logical positions, valid iff
// 0 <= p < context_lens[b]. The cache has q's dtype.
void sparse_mla_decode_paged(void* out, float* lse, const void* q, DType q_dtype, int64_t batch,
                             int64_t queries, int64_t heads, int64_t dqk, const DsaPagedCache& kv_cache,
                             const DsaPaging& paging, const int32_t* indices, int64_t topk, float sm_scale,
                             int64_t d_v, int num_threads);

// Query i of sequence b attends logical positions [0, context_lens[b] - queries + i + 1).
void dense_mla_decode_paged(void* out, float* lse, const void* q, DType q_dtype, int64_t batch,
                            int64_t queries, int64_t heads, int64_t dqk, const DsaPagedCache& kv_cache,
                            const DsaPaging& paging, float sm_scale, int64_t d_v, int num_threads);

// Instruction-set tier the DSA kernels use: 0 portable C++ (vector extensions), 1 AVX2 + FMA,
// 2 AVX-512F/BW, 3 AVX-512 + BF16 dot products. dsa_isa() is the tier in use; dsa_set_isa_limit(n) caps it (tests run every
// tier the CPU has) and returns the previous cap; the tier never exceeds what the CPU supports.
int dsa_isa();
int dsa_max_isa();
int dsa_set_isa_limit(int limit);

}  // namespace glm5
