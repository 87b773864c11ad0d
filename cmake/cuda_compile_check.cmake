# `cuda_compile_check`: compiles every csrc/ops/**/*.cu with nvcc alone. Every .cu (kernels, their .cuh
# headers and raw-pointer launchers) is torch-free by rule; the torch glue lives in *_cuda.cpp. No torch, no GPU needed: CI runs it
# whenever nvcc is present, so CUDA code cannot rot unseen.
# `cuda_glue_check` (a dependency of cuda_compile_check when torch's headers are found): the host compiler
# syntax-checks every csrc/ops/**/*_cuda.cpp against torch's headers (the CPU wheel ships the ATen/c10 CUDA ones)
# and the CUDA toolkit's headers.
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

# ---- cuda_glue_check: host-compiler syntax check of the torch glue ----
# A Python with torch: the repo's .venv first (what `make` builds), then an active virtualenv, then PATH.
find_program(PAGELLM_TORCH_PYTHON NAMES python3 python
             HINTS ${PROJECT_SOURCE_DIR}/.venv/bin ENV VIRTUAL_ENV PATH_SUFFIXES bin NO_DEFAULT_PATH)
if(NOT PAGELLM_TORCH_PYTHON)
  find_program(PAGELLM_TORCH_PYTHON NAMES python3 python)
endif()
set(_torch_includes "")
if(PAGELLM_TORCH_PYTHON)
  execute_process(
    COMMAND ${PAGELLM_TORCH_PYTHON} -c
            "import torch.utils.cpp_extension as c; print(';'.join(c.include_paths()))"
    OUTPUT_VARIABLE _torch_includes OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _torch_rc ERROR_QUIET)
  if(NOT _torch_rc EQUAL 0)
    set(_torch_includes "")
  endif()
endif()
# The toolkit's include dir (cuda_runtime.h): next to the real nvcc, or the usual places.
get_filename_component(_nvcc_real ${PAGELLM_NVCC} REALPATH)
get_filename_component(_nvcc_bin ${_nvcc_real} DIRECTORY)
find_path(PAGELLM_CUDA_INCLUDE_DIR cuda_runtime.h
          HINTS ${_nvcc_bin}/../include ${_nvcc_bin}/../targets/x86_64-linux/include ${_nvcc_bin}/../targets/sbsa-linux/include
                ENV CUDA_HOME ENV CUDA_PATH /usr/local/cuda
          PATH_SUFFIXES include targets/x86_64-linux/include
          NO_DEFAULT_PATH)
file(GLOB_RECURSE _glue_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/ops/*_cuda.cpp)
if(_torch_includes AND PAGELLM_CUDA_INCLUDE_DIR AND _glue_sources)
  set(_inc_flags "")
  foreach(_dir ${_torch_includes})
    list(APPEND _inc_flags -isystem ${_dir})
  endforeach()
  list(APPEND _inc_flags -isystem ${PAGELLM_CUDA_INCLUDE_DIR})
  # C10_CUDA_NO_CMAKE_CONFIGURE_FILE: the CPU wheel lacks the generated c10/cuda/impl/cuda_cmake_macros.h.
  set(_glue_flags -std=c++17 -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE
                  -DPAGELLM_WITH_CUDA -Wall -Wno-unused-parameter -Werror)
  set(_stamps "")
  foreach(_src ${_glue_sources})
    get_filename_component(_name ${_src} NAME_WE)
    set(_stamp ${CMAKE_BINARY_DIR}/cuda_glue_check/${_name}.stamp)
    add_custom_command(
      OUTPUT ${_stamp}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/cuda_glue_check
      COMMAND ${CMAKE_CXX_COMPILER} ${_glue_flags} ${_inc_flags} -I${PROJECT_SOURCE_DIR}/csrc ${_src}
      COMMAND ${CMAKE_COMMAND} -E touch ${_stamp}
      DEPENDS ${_src} ${_cuh_headers}
      COMMENT "syntax check (torch glue) ${_name}.cpp"
      VERBATIM)
    list(APPEND _stamps ${_stamp})
  endforeach()
  add_custom_target(cuda_glue_check DEPENDS ${_stamps})
  add_dependencies(cuda_compile_check cuda_glue_check)
  list(LENGTH _glue_sources _ng)
  message(STATUS "pagellm: cuda_glue_check covers ${_ng} *_cuda.cpp files (torch from ${PAGELLM_TORCH_PYTHON})")
else()
  message(STATUS "pagellm: no cuda_glue_check (torch headers: '${_torch_includes}', CUDA include: '${PAGELLM_CUDA_INCLUDE_DIR}')")
endif()
