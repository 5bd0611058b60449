// Host side of the Ascend C kernels: validates sizes and enqueues on the caller's stream.
//
// NOT COMPILED HERE: needs CANN (acl headers and the aclrtlaunch_*.h headers that
// ascendc_library() generates for each kernel).
#include "glm5_hal_ascend.h"

#include "acl/acl.h"
#include "aclrtlaunch_glm5_hal_hadamard_bf16.h"
#include "aclrtlaunch_glm5_hal_hadamard_f16.h"
#include "aclrtlaunch_glm5_hal_hadamard_f32.h"

namespace {

bool is_power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// Vector cores to spread rows over. The vector-core count differs per SoC (40 or 48 on
// A2, more per A3 die); asking the runtime keeps one binary right for all of them.
uint32_t vector_cores() {
  int32_t device = 0;
  int64_t cores = 0;
  if (aclrtGetDevice(&device) != ACL_SUCCESS ||
      aclrtGetDeviceInfo(static_cast<uint32_t>(device), ACL_DEV_ATTR_VECTOR_CORE_NUM, &cores) != ACL_SUCCESS ||
      cores <= 0) {
    return 40;
  }
  return static_cast<uint32_t>(cores);
}

}  // namespace

extern "C" int glm5_hal_ascend_hadamard(const void* x, void* y, int64_t rows, int64_t dim, float scale,
                                        int dtype, void* stream) {
  if (rows < 0 || !is_power_of_two(dim) || dim < GLM5_HAL_ASCEND_HADAMARD_MIN_DIM ||
      dim > GLM5_HAL_ASCEND_HADAMARD_MAX_DIM || x == nullptr || y == nullptr) {
    return GLM5_HAL_EINVAL;
  }
  if (rows == 0) {
    return 0;
  }
  const uint32_t cores = vector_cores();
  const uint32_t block_dim = rows < static_cast<int64_t>(cores) ? static_cast<uint32_t>(rows) : cores;
  auto* in = const_cast<void*>(x);
  auto s = static_cast<aclrtStream>(stream);
  switch (dtype) {
    case GLM5_HAL_F32:
      return static_cast<int>(ACLRT_LAUNCH_KERNEL(glm5_hal_hadamard_f32)(block_dim, s, in, y, rows, dim, scale));
    case GLM5_HAL_F16:
      return static_cast<int>(ACLRT_LAUNCH_KERNEL(glm5_hal_hadamard_f16)(block_dim, s, in, y, rows, dim, scale));
    case GLM5_HAL_BF16:
      return static_cast<int>(ACLRT_LAUNCH_KERNEL(glm5_hal_hadamard_bf16)(block_dim, s, in, y, rows, dim, scale));
    default:
      return GLM5_HAL_EINVAL;
  }
}
