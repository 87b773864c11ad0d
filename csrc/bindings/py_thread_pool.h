// pybind11 bindings of the CPU kernels' thread pool (csrc/ops/common/thread_pool.h).
#pragma once

#include <pybind11/pybind11.h>

namespace pagellm {
// Adds configure_thread_pool / thread_pool_info / allowed_cpus to the module.
void init_thread_pool_bindings(pybind11::module_& m);
}  // namespace pagellm
