// pagellm._C: the torch op schemas (torch_library.cpp), the CUDA kernels when built with CUDA, and the
// pybind11 bindings of the core. The CPU kernels live in one library per instruction set (_C_cpu_avx2.so,
// _C_cpu_avx512.so, registering their impls when loaded); pagellm.cpu_isa loads the best one right after
// this module, guided by cpu_features().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/py_core.h"
#include "bindings/py_graph.h"
#include "bindings/py_shm_comm.h"
#include "bindings/py_thread_pool.h"

#include "ops/common/cpu_features.h"
#include "ops/common/cpu_kernel_registry.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagellm native core: C++ block manager and scheduler (pybind11), torch.ops.pagellm kernels";
#ifdef PAGELLM_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def("cpu_features", &pagellm::cpu::cpu_features,
        "The x86-64 features this CPU has and the OS enabled (CPUID + XCR0), named as in /proc/cpuinfo.");
  m.def(
      "cpu_kernels_isa",
      []() -> py::object {
        const auto* lib = pagellm::cpu::loaded_cpu_kernel_library();
        return lib ? py::object(py::str(lib->isa)) : py::object(py::none());
      },
      "The instruction set of the loaded CPU kernel library (\"avx2\", \"avx512\"), or None before "
      "pagellm.cpu_isa loaded one.");
  m.def(
      "cpu_has_amx_bf16",
      [] {
        const auto* lib = pagellm::cpu::loaded_cpu_kernel_library();
        return lib != nullptr && lib->amx_bf16_usable();
      },
      "True when torch.ops.pagellm.linear_amx can run: the loaded CPU kernels were built with AMX, the CPU "
      "has AMX-BF16 and the OS granted the tile state.");
  pagellm::init_core_bindings(m);
  pagellm::init_graph_bindings(m);
  pagellm::init_thread_pool_bindings(m);
  pagellm::init_shm_comm_bindings(m);
}
