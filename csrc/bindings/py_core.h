#pragma once
#include <pybind11/pybind11.h>

namespace pagellm {
// Binds the C++ core (BlockManager, Scheduler, SchedulerOutput, ...) into module `m`.
void init_core_bindings(pybind11::module_& m);
}  // namespace pagellm
