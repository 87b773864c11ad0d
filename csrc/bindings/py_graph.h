// pybind11 bindings of pagellm::graph::StepGraph (record in Python, replay in C++).
#pragma once

#include <pybind11/pybind11.h>

namespace pagellm {
// Adds the StepGraph class to the module.
void init_graph_bindings(pybind11::module_& m);
}  // namespace pagellm
