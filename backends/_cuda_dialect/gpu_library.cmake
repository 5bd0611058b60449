# glm5_hal_gpu_library(): builds the CUDA-dialect kernels of this folder into one shared
# library with a GPU compiler driven directly (nvcc, mcc or hipcc), no CMake GPU language
# support needed: the three toolchains take the same kind of command line
#   <compiler> <toolchain flags> -O3 -std=c++17 -fPIC -shared -I... -o lib.so src/*.cu
# and only the toolchain flags differ (the per-vendor CMakeLists.txt give them).
#
#   glm5_hal_gpu_library(<target> COMPILER <path> OUTPUT <lib file name>
#                        DESTINATION <install dir> FLAGS <flags...> [INCLUDES <dirs...>])
set(GLM5_HAL_GPU_DIALECT_DIR "${CMAKE_CURRENT_LIST_DIR}")

function(glm5_hal_gpu_library target)
  cmake_parse_arguments(ARG "" "COMPILER;OUTPUT;DESTINATION" "FLAGS;INCLUDES" ${ARGN})
  file(GLOB sources CONFIGURE_DEPENDS "${GLM5_HAL_GPU_DIALECT_DIR}/src/*.cu")
  file(GLOB headers CONFIGURE_DEPENDS "${GLM5_HAL_GPU_DIALECT_DIR}/src/*.h" "${GLM5_HAL_GPU_DIALECT_DIR}/src/*.cuh"
       "${GLM5_HAL_GPU_DIALECT_DIR}/include/*.h" "${GLM5_HAL_KERNEL_ABI_DIR}/*.h")
  set(include_flags -I${GLM5_HAL_GPU_DIALECT_DIR}/include -I${GLM5_HAL_KERNEL_ABI_DIR} -I${GLM5_HAL_GPU_DIALECT_DIR}/src)
  foreach(dir IN LISTS ARG_INCLUDES)
    list(APPEND include_flags -I${dir})
    file(GLOB glue CONFIGURE_DEPENDS "${dir}/*.h")
    list(APPEND headers ${glue})
  endforeach()
  set(library "${CMAKE_CURRENT_BINARY_DIR}/${ARG_OUTPUT}")
  add_custom_command(
    OUTPUT "${library}"
    COMMAND "${ARG_COMPILER}" ${ARG_FLAGS} -O3 -std=c++17 -shared ${include_flags} -o "${library}" ${sources}
    DEPENDS ${sources} ${headers}
    COMMENT "glm5_hal: compiling the CUDA-dialect kernels into ${ARG_OUTPUT} with ${ARG_COMPILER}"
    VERBATIM)
  add_custom_target(${target} ALL DEPENDS "${library}")
  install(FILES "${library}" DESTINATION "${ARG_DESTINATION}"
          PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endfunction()
