// Identity of the built library, checked by the Python loader before any kernel is used.
#include "gpu_runtime.h"

extern "C" const char* glm5_hal_gpu_target(void) { return GLM5_HAL_GPU_TARGET; }

extern "C" int glm5_hal_gpu_abi_version(void) { return GLM5_HAL_GPU_ABI_VERSION; }
