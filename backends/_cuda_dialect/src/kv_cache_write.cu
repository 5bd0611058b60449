// kv_cache_write (docs/ops/kv.md): copies token rows into cache slots. Dtype-agnostic (rows are
// bytes), so it also writes FP8 caches. Slot -1 is padding; slots outside the cache are
// skipped here as well, although glm5_hal.ops has already refused them before any write.
#include "gpu_runtime.h"

namespace glm5_hal_gpu {
namespace {

constexpr int kThreads = 128;

template <class Slot>
__global__ void __launch_bounds__(kThreads)
    kv_cache_write_kernel(uint8_t* __restrict__ cache, const uint8_t* __restrict__ values,
                          const Slot* __restrict__ slots, int64_t row_bytes, int64_t num_slots) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slots[token];
  if (slot < 0 || slot >= num_slots) return;
  uint8_t* dst = cache + slot * row_bytes;
  const uint8_t* src = values + token * row_bytes;
  for (int64_t i = threadIdx.x; i < row_bytes; i += kThreads) dst[i] = src[i];
}

}  // namespace
}  // namespace glm5_hal_gpu

extern "C" int glm5_hal_gpu_kv_cache_write(void* cache, const void* values, const void* slot_mapping,
                                           int slots_are_int64, int64_t tokens, int64_t row_bytes,
                                           int64_t num_slots, void* stream) {
  using namespace glm5_hal_gpu;
  if (tokens < 0 || tokens > 2147483647 || row_bytes < 0 || num_slots < 0) return GLM5_HAL_EINVAL;
  if (tokens == 0 || row_bytes == 0) return GLM5_HAL_OK;
  if (values == nullptr || slot_mapping == nullptr || (num_slots > 0 && cache == nullptr)) {
    return GLM5_HAL_EINVAL;
  }
  uint8_t* dst = static_cast<uint8_t*>(cache);
  const uint8_t* src = static_cast<const uint8_t*>(values);
  const unsigned grid = static_cast<unsigned>(tokens);
  if (slots_are_int64) {
    kv_cache_write_kernel<int64_t><<<grid, kThreads, 0, as_stream(stream)>>>(
        dst, src, static_cast<const int64_t*>(slot_mapping), row_bytes, num_slots);
  } else {
    kv_cache_write_kernel<int32_t><<<grid, kThreads, 0, as_stream(stream)>>>(
        dst, src, static_cast<const int32_t*>(slot_mapping), row_bytes, num_slots);
  }
  return launch_status();
}
