// The kunlun backend's own XPU C++ kernels (XTDK) beyond the paged sparse MLA decode kernel
// every kernel library shares (glm5_hal_kernel_abi.h): the C entry points kernels.py loads
// with ctypes.
//
// Same convention as csrc/: raw device pointers, sizes, and the stream to launch on; no
// libtorch. Inputs are validated in Python (glm5_hal.ops + the adapter's supports()), but
// the kernels still check every index they dereference: an index outside the cache is
// skipped, never read. Built only with the XTDK toolchain (XTDK_PATH); not compiled here.
#pragma once

#include <stdint.h>

#include "glm5_hal_kernel_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

// kv_cache_gather (docs/ops/kv.md): for each sequence b and position p < context_lens[b], copies
// cache row block_table[b, p / block_size] * block_size + p % block_size (row_bytes bytes)
// to out row out_offsets[b] + p. out_offsets is int64 [batch] (exclusive prefix sums of
// context_lens). A byte copy, so any element type (including FP8) works. Rows whose block id
// is outside [0, num_blocks) are skipped. Returns GLM5_HAL_OK, GLM5_HAL_EINVAL, or the XPU runtime
// error code.
int glm5_hal_xpu_kv_cache_gather(const void* cache, const int32_t* block_table, const int32_t* context_lens,
                                 const int64_t* out_offsets, void* out, int64_t batch, int64_t num_blocks,
                                 int64_t block_size, int64_t max_blocks, int64_t row_bytes, void* stream);

#ifdef __cplusplus
}
#endif
