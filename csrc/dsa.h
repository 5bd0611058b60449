// DeepSeek Sparse Attention kernels (docs/ops/dsa.md): the lightning indexer (logits, fused
// score + top-k, paged top-k) and MLA attention in absorbed (MQA) mode over sparse indices,
// sparse paged decode and dense paged decode.
//
// Every index the kernels dereference (key ranges, context lengths, block ids) is
// validated before anything is written; violations raise glm5::InvalidInput. Indices the
// contract says are ignored (sparse attention entries outside the valid range) are skipped.
#pragma once

#include "view.h"

namespace glm5 {

// q, weights, indices, context lengths and the outputs are contiguous; keys and KV rows are
// read in place with their strides (non-overlapping rows, the last dim contiguous): key rows
// k [S, D], kv [S, Dqk], paged caches [num_blocks, block_size, D]; block tables int32
// [B, max_blocks] rows of any stride. Float8 keys (float8_e4m3fn) come with float32 scales,
// one per key row: k_scale [S] or k_cache_scale [num_blocks, block_size], any strides.

// out [T, S] float32 (rows of any stride >= S): out[t, s] = sum_h weights[t, h] *
// relu(q[t, h] . k[s]) for k_start[t] <= s < k_end[t], -inf elsewhere. q [T, H, D] of a float
// dtype, k of q's dtype or float8 with k_scale (null otherwise), weights [T, H] float32,
// k_start / k_end int32 [T].
void indexer_logits(const View& out, const DenseIn& q, const DisjointIn& k, const ScalesIn* k_scale,
                    const DenseIn& weights, const DenseIn& k_start, const DenseIn& k_end, int num_threads);

// out int32 [T, topk]: positions of the topk largest indexer logits of each row, left-packed,
// -1 padded. Fused: no [T, S] logits tensor is formed.
void indexer_topk(const View& out, const DenseIn& q, const DisjointIn& k, const ScalesIn* k_scale,
                  const DenseIn& weights, const DenseIn& k_start, const DenseIn& k_end, int num_threads);

// out int32 [B, N, topk]: logical positions; query i of sequence b sees
// [0, context_lens[b] - N + i + 1). q [B, N, H, D], weights float32 [B, N, H], k_cache of q's
// dtype or float8 with k_cache_scale (null otherwise).
void indexer_topk_paged(const View& out, const DenseIn& q, const DisjointIn& k_cache, const ScalesIn* k_cache_scale,
                        const DenseIn& weights, const DisjointIn& block_table, const DenseIn& context_lens,
                        int num_threads);

// (out [T, H, d_v] of q's dtype, lse float32 [T, H]) over rows kv[indices[t, j]] for
// 0 <= indices[t, j] < S (others ignored, duplicates counted). q [T, H, Dqk], kv [S, Dqk] of
// q's dtype, indices int32 [T, topk]; d_v <= Dqk is out's last dim.
void sparse_mla_attention(const View& out, const View& lse, const DenseIn& q, const DisjointIn& kv,
                          const DenseIn& indices, float sm_scale, int num_threads);

// q [B, N, H, Dqk]; indices int32 [B, N, topk] logical positions, valid iff
// 0 <= p < context_lens[b]; out [B, N, H, d_v], lse [B, N, H]. The cache has q's dtype.
void sparse_mla_decode_paged(const View& out, const View& lse, const DenseIn& q, const DisjointIn& kv_cache,
                             const DisjointIn& block_table, const DenseIn& context_lens, const DenseIn& indices,
                             float sm_scale,
                             int num_threads);

// Query i of sequence b attends logical positions [0, context_lens[b] - N + i + 1).
void dense_mla_decode_paged(const View& out, const View& lse, const DenseIn& q, const DisjointIn& kv_cache,
                            const DisjointIn& block_table, const DenseIn& context_lens, float sm_scale,
                            int num_threads);

// Instruction-set tier the DSA kernels use: 0 portable C++ (vector extensions), 1 AVX2 + FMA,
// 2 AVX-512F/BW, 3 AVX-512 + BF16 dot products. dsa_isa() is the tier in use; dsa_set_isa_limit(n) caps it (tests run every
// tier the CPU has) and returns the previous cap; the tier never exceeds what the CPU supports.
int dsa_isa();
int dsa_max_isa();
int dsa_set_isa_limit(int limit);

}  // namespace glm5
