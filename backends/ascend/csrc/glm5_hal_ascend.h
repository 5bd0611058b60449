// Host entry points of the ascend backend's Ascend C kernels (libglm5_hal_ascend_kernels.so).
//
// Same convention as the shared csrc/ kernels: raw pointers, sizes, and here the aclrtStream
// to enqueue on (torch_npu's current stream). Pointers are device (HBM) addresses of
// contiguous tensors. Every function validates its sizes before launching and returns 0 or
// an error code (an aclError from the launch, or GLM5_HAL_EINVAL), with the dtype and status
// codes every glm5_hal kernel library shares (glm5_hal_kernel_abi.h). Python binds these
// with ctypes (backends/ascend/kernels.py), so the ABI is plain C.
#pragma once

#include <stdint.h>

#include "glm5_hal_kernel_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

// Largest row the kernel keeps in one core's unified buffer: 16 bytes of UB per element
// (double-buffered input and output plus two float32 work rows) within the 192 KiB UB.
#define GLM5_HAL_ASCEND_HADAMARD_MAX_DIM 8192
#define GLM5_HAL_ASCEND_HADAMARD_MIN_DIM 16

// y[r, :] = (x[r, :] @ H_dim) * scale for r in [0, rows): the Sylvester-ordered
// Walsh-Hadamard transform of each row, computed in float32. dim is a power of two in
// [GLM5_HAL_ASCEND_HADAMARD_MIN_DIM, GLM5_HAL_ASCEND_HADAMARD_MAX_DIM]; x and y may alias.
int glm5_hal_ascend_hadamard(const void* x, void* y, int64_t rows, int64_t dim, float scale,
                             int dtype, void* stream);

#ifdef __cplusplus
}
#endif
