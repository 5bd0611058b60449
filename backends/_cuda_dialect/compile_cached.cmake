# cmake -DCOMMAND=<compiler|arg|...> -DINPUTS=<file|...> -DOUTPUT=<library> -DCACHE_DIR=<dir> -P compile_cached.cmake
# Runs COMMAND (which writes OUTPUT) unless CACHE_DIR holds a build for the same key: the
# SHA-256 of the compiler's --version, the command line (OUTPUT's folder left out, so that
# two checkouts share builds) and the contents of every INPUTS file. Used by
# glm5_hal_gpu_library() when GLM5_HAL_KERNEL_CACHE is set.
string(REPLACE "|" ";" command "${COMMAND}")
string(REPLACE "|" ";" inputs "${INPUTS}")
list(GET command 0 compiler)
execute_process(COMMAND "${compiler}" --version OUTPUT_VARIABLE version ERROR_VARIABLE version)
get_filename_component(output_dir "${OUTPUT}" DIRECTORY)
get_filename_component(output_name "${OUTPUT}" NAME)
string(REPLACE "${output_dir}" "<out>" key_text "${version}\n${command}")
foreach(input IN LISTS inputs)
  file(SHA256 "${input}" digest)
  get_filename_component(input_name "${input}" NAME)
  string(APPEND key_text "\n${input_name} ${digest}")
endforeach()
string(SHA256 key "${key_text}")
set(cached "${CACHE_DIR}/${key}/${output_name}")
if(EXISTS "${cached}")
  message(STATUS "glm5_hal: ${output_name} from the kernel cache (${CACHE_DIR}/${key})")
  execute_process(COMMAND "${CMAKE_COMMAND}" -E copy "${cached}" "${OUTPUT}")
  return()
endif()
execute_process(COMMAND ${command} RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "glm5_hal: compiling ${output_name} failed (${status})")
endif()
file(MAKE_DIRECTORY "${CACHE_DIR}/${key}")
# copy, then rename: a concurrent build never sees a half-written library
execute_process(COMMAND "${CMAKE_COMMAND}" -E copy "${OUTPUT}" "${CACHE_DIR}/${key}/${output_name}.tmp")
file(RENAME "${CACHE_DIR}/${key}/${output_name}.tmp" "${cached}")
message(STATUS "glm5_hal: ${output_name} stored in the kernel cache (${CACHE_DIR}/${key})")
