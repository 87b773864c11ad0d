// pagellm._C: one extension carries both the torch custom ops (registered by static initializers in
// torch_library.cpp and the per-device *_cpu.cpp / *_cuda.cpp files) and the pybind11 core bindings.
#include <pybind11/pybind11.h>

#include "bindings/py_core.h"
#include "bindings/py_graph.h"
#include "bindings/py_shm_comm.h"
#include "bindings/py_thread_pool.h"

#include "ops/linear/amx_support.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagellm native core: C++ block manager and scheduler (pybind11), torch.ops.pagellm kernels";
#ifdef PAGELLM_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def("cpu_has_amx_bf16", &pagellm::cpu::amx::amx_bf16_usable,
        "True when torch.ops.pagellm.linear_amx can run: built with AMX, the CPU has AMX-BF16 and the OS "
        "granted the tile state.");
  pagellm::init_core_bindings(m);
  pagellm::init_graph_bindings(m);
  pagellm::init_thread_pool_bindings(m);
  pagellm::init_shm_comm_bindings(m);
}
