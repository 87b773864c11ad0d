# The CPU kernels, one loadable library per instruction set (see extension.cmake). Every *_cpu.cpp under
# csrc/ops is a kernel source except the torch-free runtime pieces that _C and _C_cpu_common hold.
file(GLOB_RECURSE PAGELLM_CPU_KERNEL_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/ops/*_cpu.cpp)
list(FILTER PAGELLM_CPU_KERNEL_SOURCES EXCLUDE REGEX "/csrc/ops/(common/thread_pool_cpu|comm/[^/]*)\\.cpp$")

# pagellm_add_cpu_kernels(<isa> <compile flags...>): _C_cpu_<isa>.so. Hidden visibility: the two
# libraries define the same inline functions compiled for different CPUs, and none of them may bind to
# another library's copy. -ffp-contract=off: GCC's intrinsics are plain vector arithmetic that it may fuse
# into FMAs wherever its per-target heuristics see fit, so a separate multiply and add could round once in
# one library and twice in the other; off, each library fuses exactly the vfma calls of the source.
function(pagellm_add_cpu_kernels isa)
  set(target _C_cpu_${isa})
  add_library(${target} MODULE ${PAGELLM_CPU_KERNEL_SOURCES})
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/csrc)
  target_compile_definitions(${target} PRIVATE PAGELLM_CPU_ISA_NAME="${isa}")
  target_compile_options(${target} PRIVATE ${ARGN} -O3 -ffp-contract=off ${PAGELLM_CXX_WARNINGS})
  target_link_libraries(${target} PRIVATE _C_cpu_common torch OpenMP::OpenMP_CXX)
  set_target_properties(${target} PROPERTIES PREFIX "" SUFFIX ".so" CXX_VISIBILITY_PRESET hidden
                        VISIBILITY_INLINES_HIDDEN ON INSTALL_RPATH "${PAGELLM_INSTALL_RPATH}")
  # _C is of no use without a kernel library: building _C builds them all.
  add_dependencies(_C ${target})
  install(TARGETS ${target} LIBRARY DESTINATION pagellm)
endfunction()

# Keep these flags in step with CPU_ISA_FEATURES in python/pagellm/cpu_isa.py (what each library needs).
# -Wno-*uninitialized: GCC 12 flags the `__Y = __Y` idiom of its own intrinsics headers inside the
# target("avx512...") functions of gguf / awq / int8 (hundreds of lines); the avx512 library compiles the
# same sources with these warnings on.
# PAGELLM_CPU_ISAS: the libraries to build. Both by default (a wheel runs on any x86-64-v3 CPU); the GPU-machine
# build (tools/gpu/build.sh) builds only the one its CPU runs, to save minutes of a short lease.
set(PAGELLM_CPU_ISAS "avx2;avx512" CACHE STRING "CPU kernel libraries to build: avx2, avx512 or both")
if("avx2" IN_LIST PAGELLM_CPU_ISAS)
  pagellm_add_cpu_kernels(avx2 -march=x86-64-v3 -Wno-uninitialized -Wno-maybe-uninitialized)
endif()
if("avx512" IN_LIST PAGELLM_CPU_ISAS)
  pagellm_add_cpu_kernels(avx512 -march=x86-64-v4 -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16)
endif()
