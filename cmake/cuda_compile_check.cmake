# `cuda_compile_check`: compiles every csrc/ops/**/*.cu with nvcc alone. Every .cu (kernels, their .cuh
# headers and raw-pointer launchers) is torch-free by rule; the torch glue lives in *_cuda.cpp. No torch, no GPU needed: CI runs it
# whenever nvcc is present, so CUDA code cannot rot unseen.
if(NOT PAGELLM_CUDA_COMPILE_CHECK)
  return()
endif()
find_program(PAGELLM_NVCC nvcc HINTS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
if(NOT PAGELLM_NVCC)
  message(STATUS "pagellm: nvcc not found, no cuda_compile_check target")
  return()
endif()
file(GLOB_RECURSE _cu_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/ops/*.cu)
file(GLOB_RECURSE _cuh_headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/ops/*.cuh ${PROJECT_SOURCE_DIR}/csrc/ops/*.h)
set(PAGELLM_CUDA_CHECK_ARCHS "sm_80;sm_90" CACHE STRING "archs for the nvcc-only compile check")
set(_outputs "")
foreach(_src ${_cu_sources})
  get_filename_component(_name ${_src} NAME_WE)
  set(_obj ${CMAKE_BINARY_DIR}/cuda_compile_check/${_name}.o)
  set(_gencode "")
  foreach(_arch ${PAGELLM_CUDA_CHECK_ARCHS})
    string(REPLACE "sm_" "" _num ${_arch})
    list(APPEND _gencode -gencode=arch=compute_${_num},code=${_arch})
  endforeach()
  add_custom_command(
    OUTPUT ${_obj}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/cuda_compile_check
    COMMAND ${PAGELLM_NVCC} -std=c++17 -O2 ${_gencode} -I${PROJECT_SOURCE_DIR}/csrc -Werror all-warnings -c ${_src} -o ${_obj}
    DEPENDS ${_src}
    DEPENDS ${_cuh_headers}
    COMMENT "nvcc (torch-free) ${_name}.cu"
    VERBATIM)
  list(APPEND _outputs ${_obj})
endforeach()
list(LENGTH _cu_sources _n)
add_custom_target(cuda_compile_check DEPENDS ${_outputs})
message(STATUS "pagellm: cuda_compile_check covers ${_n} .cu files with ${PAGELLM_NVCC}")
