# pagellm._C: torch custom ops (torch.ops.pagellm.*) + pybind11 bindings of the C++ core.
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

file(GLOB PAGELLM_BINDING_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/bindings/*.cpp)
file(GLOB_RECURSE PAGELLM_CPU_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/ops/*_cpu.cpp)
file(GLOB PAGELLM_GRAPH_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/graph/*.cpp)
set(PAGELLM_EXT_SOURCES ${PAGELLM_BINDING_SOURCES} ${PAGELLM_GRAPH_SOURCES} ${PAGELLM_CPU_SOURCES})
if(PAGELLM_WITH_CUDA)
  # *.cu are torch-free kernels + raw-pointer launchers; *_cuda.cpp are the torch glue (TORCH_LIBRARY_IMPL CUDA).
  file(GLOB_RECURSE PAGELLM_CUDA_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/ops/*.cu ${PROJECT_SOURCE_DIR}/csrc/ops/*_cuda.cpp)
  list(APPEND PAGELLM_EXT_SOURCES ${PAGELLM_CUDA_SOURCES})
endif()

pybind11_add_module(_C MODULE ${PAGELLM_EXT_SOURCES})
target_include_directories(_C PRIVATE ${PROJECT_SOURCE_DIR}/csrc)
# torch_python: the StepGraph bindings convert Python arguments to IValues with torch's own converter.
find_library(PAGELLM_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED NO_DEFAULT_PATH)
target_link_libraries(_C PRIVATE pagellm_core ${TORCH_LIBRARIES} ${PAGELLM_TORCH_PYTHON_LIBRARY} OpenMP::OpenMP_CXX)
target_compile_definitions(_C PRIVATE $<$<BOOL:${PAGELLM_WITH_CUDA}>:PAGELLM_WITH_CUDA>)
target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=${PAGELLM_CPU_ARCH} -O3 -Wall -Wno-unused-parameter>)
if(PAGELLM_WITH_CUDA)
  target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3 --use_fast_math -lineinfo --expt-relaxed-constexpr>)
endif()
# Find libtorch/libc10 in the installed torch at run time (torch is imported first anyway).
set_target_properties(_C PROPERTIES INSTALL_RPATH "$ORIGIN/../torch/lib")
install(TARGETS _C LIBRARY DESTINATION pagellm)
