# pagellm._C (torch op schemas, CUDA kernels, pybind11 bindings of the core) and the CPU kernels, built once
# per instruction set so that one build runs well on every x86-64-v3 CPU:
#   _C.*.so            bindings, step graph, shm all-reduce, CUDA kernels              -march=x86-64-v3
#   _C_cpu_common.so   the CPU kernels' one thread pool, cpu_features, the kernel registry (torch-free)
#   _C_cpu_avx2.so     every csrc/ops/**/*_cpu.cpp                                     -march=x86-64-v3
#   _C_cpu_avx512.so   the same sources                 -march=x86-64-v4 + AVX512-BF16 + VNNI + AMX-BF16
# pagellm.cpu_isa loads the best kernel library the CPU runs (PAGELLM_CPU_ISA forces one). Kernels that
# pick their own instructions at run time (gguf / awq / int8 with target attributes, AMX behind a CPUID
# check) do so in either library.
find_package(Python REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import torch.utils, pybind11; print(torch.utils.cmake_prefix_path + ';' + pybind11.get_cmake_dir())"
  OUTPUT_VARIABLE _prefixes OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
list(APPEND CMAKE_PREFIX_PATH ${_prefixes})
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import torch; print(1 if torch.version.cuda else 0)"
  OUTPUT_VARIABLE PAGELLM_TORCH_HAS_CUDA OUTPUT_STRIP_TRAILING_WHITESPACE)

include(CheckLanguage)
check_language(CUDA)
if(PAGELLM_TORCH_HAS_CUDA AND CMAKE_CUDA_COMPILER)
  set(PAGELLM_WITH_CUDA ON)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  enable_language(CUDA)
  message(STATUS "pagellm: building CPU and CUDA kernels (archs ${CMAKE_CUDA_ARCHITECTURES})")
else()
  set(PAGELLM_WITH_CUDA OFF)
  message(STATUS "pagellm: CPU-only build (torch CUDA=${PAGELLM_TORCH_HAS_CUDA}, nvcc=${CMAKE_CUDA_COMPILER})")
endif()

find_package(pybind11 CONFIG REQUIRED)
find_package(Torch REQUIRED)
find_package(OpenMP REQUIRED)  # at::parallel_for is inline OpenMP; torch's libgomp.so.1 is reused at run time
find_package(Threads REQUIRED)

set(PAGELLM_BASE_ARCH_FLAGS -march=x86-64-v3)
set(PAGELLM_CXX_WARNINGS -Wall -Wno-unused-parameter)
# Installed side by side in the package; each finds the others in its own directory, torch in the wheel's.
set(PAGELLM_INSTALL_RPATH "$ORIGIN;$ORIGIN/../torch/lib")

add_library(_C_cpu_common SHARED
  ${PROJECT_SOURCE_DIR}/csrc/ops/common/thread_pool_cpu.cpp
  ${PROJECT_SOURCE_DIR}/csrc/ops/common/cpu_features.cpp
  ${PROJECT_SOURCE_DIR}/csrc/ops/common/cpu_kernel_registry.cpp)
target_include_directories(_C_cpu_common PRIVATE ${PROJECT_SOURCE_DIR}/csrc)
target_link_libraries(_C_cpu_common PRIVATE Threads::Threads)
target_compile_options(_C_cpu_common PRIVATE ${PAGELLM_BASE_ARCH_FLAGS} -O3 ${PAGELLM_CXX_WARNINGS})
set_target_properties(_C_cpu_common PROPERTIES PREFIX "" INSTALL_RPATH "${PAGELLM_INSTALL_RPATH}")

file(GLOB PAGELLM_BINDING_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/bindings/*.cpp)
file(GLOB PAGELLM_GRAPH_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/graph/*.cpp)
set(PAGELLM_EXT_SOURCES ${PAGELLM_BINDING_SOURCES} ${PAGELLM_GRAPH_SOURCES}
    ${PROJECT_SOURCE_DIR}/csrc/ops/comm/shm_allreduce_cpu.cpp)
if(PAGELLM_WITH_CUDA)
  # *.cu are torch-free kernels + raw-pointer launchers; *_cuda.cpp are the torch glue (TORCH_LIBRARY_IMPL CUDA).
  file(GLOB_RECURSE PAGELLM_CUDA_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/ops/*.cu ${PROJECT_SOURCE_DIR}/csrc/ops/*_cuda.cpp)
  list(APPEND PAGELLM_EXT_SOURCES ${PAGELLM_CUDA_SOURCES})
endif()

pybind11_add_module(_C MODULE ${PAGELLM_EXT_SOURCES})
target_include_directories(_C PRIVATE ${PROJECT_SOURCE_DIR}/csrc)
# torch_python: the StepGraph bindings convert Python arguments to IValues with torch's own converter.
find_library(PAGELLM_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED NO_DEFAULT_PATH)
target_link_libraries(_C PRIVATE _C_cpu_common pagellm_core ${TORCH_LIBRARIES} ${PAGELLM_TORCH_PYTHON_LIBRARY})
target_compile_definitions(_C PRIVATE $<$<BOOL:${PAGELLM_WITH_CUDA}>:PAGELLM_WITH_CUDA>)
target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${PAGELLM_BASE_ARCH_FLAGS} -O3 ${PAGELLM_CXX_WARNINGS}>)
if(PAGELLM_WITH_CUDA)
  target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3 --use_fast_math -lineinfo --expt-relaxed-constexpr>)
endif()
set_target_properties(_C PROPERTIES INSTALL_RPATH "${PAGELLM_INSTALL_RPATH}")
install(TARGETS _C _C_cpu_common LIBRARY DESTINATION pagellm)

include(${CMAKE_CURRENT_LIST_DIR}/cpu_kernels.cmake)
