// Paged KV cache ops (docs/ops/kv.md). A cache is [num_blocks, block_size, D], contiguous;
// slot s is row s of its [num_blocks * block_size, D] view. Slot mappings [T] are int32 or
// int64, -1 meaning "padding, write nothing"; block tables [B, max_blocks] (rows of any stride)
// and context lengths [B] are int32. Rows of the inputs written into a cache may have any stride.
#pragma once

#include "view.h"

namespace glm5 {

// cache row slot_mapping[t] = values row t for each slot >= 0; values [T, D] of the cache's
// element type (any: rows are copied as bytes). Slots outside [-1, num_slots) or repeated
// (other than -1) raise before anything is written.
void kv_cache_write(const View& cache, const RowsIn& values, const DenseIn& slot_mapping, int num_threads);

// FP8-quantizes each row of k [T, D] (a float dtype) as one block of D (fp8_block_quant's rule)
// into row slot_mapping[t] of k_cache (float8_e4m3fn [num_blocks, block_size, D]) and entry
// slot_mapping[t] of k_scale (float32 [num_blocks, block_size]). Slot rules as kv_cache_write.
void indexer_k_cache_write(const RowsIn& k, const View& k_cache, const View& k_scale, const DenseIn& slot_mapping,
                           bool ue8m0, int num_threads);

// Validates context_lens (0 <= len <= max_blocks * block_size) and returns their sum: the rows
// of kv_cache_gather's output.
int64_t kv_cache_gather_rows(const View& cache, const View& block_table, const DenseIn& context_lens);

// out [sum(context_lens), D] (contiguous, the cache's dtype) = the logical rows of every
// sequence, in batch order: position p of sequence b is row (block_table[b, p / block_size] *
// block_size + p % block_size) of the cache. Block ids of the blocks in use must lie in
// [0, num_blocks) (entries past them are not read).
void kv_cache_gather(const View& out, const DenseIn& cache, const RowsIn& block_table, const DenseIn& context_lens,
                     int num_threads);

}  // namespace glm5
