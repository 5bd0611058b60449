// silu_and_mul (docs/ops/common.md): out = silu(gate) * up over the [gate, up] halves of each row,
// in float32 and rounded once.
#include "gpu_runtime.h"
#include "numeric.cuh"

namespace glm5_hal_gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <class Elem>
__global__ void __launch_bounds__(kThreads)
    silu_and_mul_kernel(const typename Elem::Storage* __restrict__ x, typename Elem::Storage* __restrict__ out,
                        int64_t rows, int64_t half) {
  const int64_t total = rows * half;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < total; e += step) {
    const int64_t row = e / half;
    const int64_t i = e % half;
    const float gate = Elem::load(x, row * 2 * half + i);
    const float up = Elem::load(x, row * 2 * half + half + i);
    Elem::store(out, e, gate / (1.f + expf(-gate)) * up);
  }
}

template <class Elem>
void launch(const void* x, void* out, int64_t rows, int64_t half, cudaStream_t stream) {
  int64_t blocks = (rows * half + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  silu_and_mul_kernel<Elem><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const typename Elem::Storage*>(x), static_cast<typename Elem::Storage*>(out), rows, half);
}

}  // namespace
}  // namespace glm5_hal_gpu

extern "C" int glm5_hal_gpu_silu_and_mul(const void* x, void* out, int64_t rows, int64_t half, int dtype,
                                         void* stream) {
  using namespace glm5_hal_gpu;
  if (rows < 0 || half < 0) return GLM5_HAL_EINVAL;
  if (rows == 0 || half == 0) return GLM5_HAL_OK;
  if (x == nullptr || out == nullptr) return GLM5_HAL_EINVAL;
  const cudaStream_t s = as_stream(stream);
  switch (dtype) {
    case GLM5_HAL_F32: launch<F32>(x, out, rows, half, s); break;
    case GLM5_HAL_F16: launch<F16>(x, out, rows, half, s); break;
    case GLM5_HAL_BF16: launch<BF16>(x, out, rows, half, s); break;
    default: return GLM5_HAL_EINVAL;
  }
  return launch_status();
}
