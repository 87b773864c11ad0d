// pagellm._C: one extension carries both the torch custom ops (registered by static initializers in
// torch_library.cpp and the per-device *_cpu.cpp / *_cuda.cpp files) and the pybind11 core bindings.
#include <pybind11/pybind11.h>

#include "bindings/py_core.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagellm native core: C++ block manager and scheduler (pybind11), torch.ops.pagellm kernels";
#ifdef PAGELLM_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  pagellm::init_core_bindings(m);
}
