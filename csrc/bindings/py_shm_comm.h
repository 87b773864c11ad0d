// pybind11 bindings of the shared-memory all-reduce (csrc/ops/comm/shm_allreduce.h).
#pragma once

#include <pybind11/pybind11.h>

namespace pagellm {
// Adds the ShmAllReduce class and shm_unlink to the module.
void init_shm_comm_bindings(pybind11::module_& m);
}  // namespace pagellm
