# glm5_hal_gpu_library(): builds the CUDA-dialect kernels of this folder into one shared
# library with a GPU compiler driven directly (nvcc, mcc or hipcc), no CMake GPU language
# support needed: the three toolchains take the same kind of command line
#   <compiler> <toolchain flags> -O3 -std=c++17 -fPIC -shared -I... -o lib.so src/*.cu
# and only the toolchain flags differ (the per-vendor CMakeLists.txt give them).
#
#   glm5_hal_gpu_library(<target> COMPILER <path> OUTPUT <lib file name>
#                        DESTINATION <install dir> FLAGS <flags...> [INCLUDES <dirs...>])
#
# With GLM5_HAL_KERNEL_CACHE set (a folder; default: the environment variable of that name),
# a build is looked up there by the SHA-256 of the compiler's version, the command line and
# every source and header, and stored there after compiling: a fresh checkout (CI) rebuilds
# only what changed. Unset: always compiled.
set(GLM5_HAL_GPU_DIALECT_DIR "${CMAKE_CURRENT_LIST_DIR}")
set(GLM5_HAL_KERNEL_CACHE "$ENV{GLM5_HAL_KERNEL_CACHE}" CACHE PATH
    "Folder of cached GPU kernel builds, keyed by a hash of compiler, flags and sources (empty: no cache)")

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
  set(command "${ARG_COMPILER}" ${ARG_FLAGS} -O3 -std=c++17 -shared ${include_flags} -o "${library}" ${sources})
  if(GLM5_HAL_KERNEL_CACHE)
    # the command and the inputs travel to the script as ;-lists escaped for -D
    string(REPLACE ";" "|" command_arg "${command}")
    string(REPLACE ";" "|" inputs_arg "${sources};${headers}")
    add_custom_command(
      OUTPUT "${library}"
      COMMAND "${CMAKE_COMMAND}" "-DCOMMAND=${command_arg}" "-DINPUTS=${inputs_arg}" "-DOUTPUT=${library}"
              "-DCACHE_DIR=${GLM5_HAL_KERNEL_CACHE}" -P "${GLM5_HAL_GPU_DIALECT_DIR}/compile_cached.cmake"
      DEPENDS ${sources} ${headers} "${GLM5_HAL_GPU_DIALECT_DIR}/compile_cached.cmake"
      COMMENT "glm5_hal: the CUDA-dialect kernels -> ${ARG_OUTPUT} (${ARG_COMPILER}, cache ${GLM5_HAL_KERNEL_CACHE})"
      VERBATIM)
  else()
    add_custom_command(
      OUTPUT "${library}"
      COMMAND ${command}
      DEPENDS ${sources} ${headers}
      COMMENT "glm5_hal: compiling the CUDA-dialect kernels into ${ARG_OUTPUT} with ${ARG_COMPILER}"
      VERBATIM)
  endif()
  add_custom_target(${target} ALL DEPENDS "${library}")
  install(FILES "${library}" DESTINATION "${ARG_DESTINATION}"
          PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endfunction()
