// Paged KV cache ops (OPS.md section 6). A cache is [num_blocks, block_size, D], contiguous;
// slot s is row s of its [num_blocks * block_size, D] view. Slot mappings are int32 or int64,
// -1 meaning "padding, write nothing"; block tables and context lengths are int32.
#pragma once

#include "core.h"

namespace glm5 {

// cache row slots[t] = values row t for each slots[t] >= 0. Rows are row_bytes bytes (any
// element type: the cache and values share it), values rows values_row_stride_bytes apart.
// Slots outside [-1, num_slots) or repeated (other than -1) raise before anything is written.
void kv_cache_write(void* cache, int64_t num_slots, int64_t row_bytes, const void* values,
                    int64_t values_row_stride_bytes, int64_t tokens, const void* slots, DType slot_dtype,
                    int num_threads);

// FP8-quantizes each row of k[T, D] (row stride k_row_stride elements) as one block of D
// (fp8_block_quant's rule) into row slots[t] of k_cache (uint8 e4m3 codes, [num_slots, D]) and
// entry slots[t] of k_scale (float32, [num_slots]). Slot rules as kv_cache_write.
void indexer_k_cache_write(const void* k, int64_t tokens, int64_t dim, int64_t k_row_stride, DType k_dtype,
                           uint8_t* k_cache, float* k_scale, int64_t num_slots, const void* slots,
                           DType slot_dtype, bool ue8m0, int num_threads);

// Validates context_lens[B] (0 <= len <= max_blocks * block_size) and returns their sum.
int64_t kv_cache_gather_rows(const int32_t* context_lens, int64_t batch, int64_t max_blocks, int64_t block_size);

// out[sum(context_lens), row] = the logical rows of every sequence, in batch order: position p
// of sequence b is row (block_table[b, p / block_size] * block_size + p % block_size) of the
// cache. out_rows must equal sum(context_lens); block ids of the blocks in use must lie in
// [0, num_blocks) (entries past them are not read).
void kv_cache_gather(void* out, int64_t out_rows, const void* cache, int64_t num_blocks, int64_t block_size,
                     int64_t row_bytes, const int32_t* block_table, int64_t batch, int64_t max_blocks,
                     int64_t block_table_row_stride, const int32_t* context_lens, int num_threads);

}  // namespace glm5
