// StepGraph for Python: argument descriptors (built by pagellm/step_graph/recorder.py) are converted to
// IValues once, with the operator schema's argument types, so a replay never touches Python objects.
//   ("s", slot)          a value slot
//   ("c", obj)           a constant (converted with the argument's schema type)
//   ("d",)               the schema's default value
//   ("l", [elements])    a Tensor[] / Tensor?[] of ("s", slot) / ("c", tensor) / ("n",) elements
#include "bindings/py_graph.h"

#include <pybind11/stl.h>
#include <ATen/ScalarOps.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "graph/step_graph.h"

namespace py = pybind11;

namespace pagellm {
namespace {

using graph::ArgSource;
using graph::OutputTarget;
using graph::StepGraph;

// A Python number passed where the schema takes a Tensor (`x * 2`): a 0-dim "wrapped number" tensor, as
// torch's argument parser makes, so type promotion treats it as a scalar.
bool is_python_number(py::handle obj) {
  return py::isinstance<py::bool_>(obj) || py::isinstance<py::int_>(obj) || py::isinstance<py::float_>(obj);
}

c10::IValue constant(py::handle obj, const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (const auto* opt = t->castRaw<c10::OptionalType>()) t = opt->getElementType();
  if (t->kind() == c10::TypeKind::TensorType && is_python_number(obj)) {
    at::Tensor wrapped = c10::scalar_to_tensor(torch::jit::toIValue(obj, c10::NumberType::get()).toScalar());
    wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
    return wrapped;
  }
  return torch::jit::toIValue(obj, type);
}

// One descriptor of a value of schema type `type` (an argument, or a list element when in_list).
ArgSource source(const py::tuple& d, const c10::TypePtr& type, const std::string& name, bool in_list,
                 const std::optional<c10::IValue>& default_value = std::nullopt) {
  const std::string kind = d[0].cast<std::string>();
  ArgSource a;
  if (kind == "s") {
    a.kind = ArgSource::Kind::kSlot;
    a.slot = d[1].cast<int64_t>();
  } else if (kind == "c") {
    a.constant = constant(d[1], type);
  } else if (kind == "n" && in_list) {
    a.constant = c10::IValue();
  } else if (kind == "d" && !in_list) {
    if (!default_value.has_value()) throw std::invalid_argument("argument '" + name + "' has no default value");
    a.constant = *default_value;
  } else if (kind == "l" && !in_list) {
    const auto* list = type->castRaw<c10::ListType>();
    if (list == nullptr) throw std::invalid_argument("argument '" + name + "' is not a list");
    a.kind = ArgSource::Kind::kList;
    a.list_type = type;
    for (py::handle e : d[1].cast<py::list>()) {
      a.elements.push_back(source(e.cast<py::tuple>(), list->getElementType(), name, /*in_list=*/true));
    }
  } else {
    throw std::invalid_argument("argument '" + name + "': unknown descriptor kind '" + kind + "'");
  }
  return a;
}

void add_node(StepGraph& g, const std::string& name, const std::string& overload, const py::list& args,
              const std::vector<std::tuple<int64_t, int64_t, int64_t>>& outputs) {
  const c10::FunctionSchema& schema = StepGraph::schema_of(name, overload);
  if (args.size() != schema.arguments().size()) {
    throw std::invalid_argument(name + "." + overload + " takes " + std::to_string(schema.arguments().size()) +
                                " arguments, got " + std::to_string(args.size()));
  }
  std::vector<ArgSource> sources;
  sources.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::Argument& arg = schema.arguments()[i];
    sources.push_back(source(args[i].cast<py::tuple>(), arg.real_type(), arg.name(), /*in_list=*/false, arg.default_value()));
  }
  std::vector<OutputTarget> targets;
  for (const auto& [index, element, slot] : outputs) targets.push_back(OutputTarget{index, element, slot});
  g.add_node(name, overload, std::move(sources), std::move(targets));
}

}  // namespace

void init_graph_bindings(py::module_& m) {
  py::class_<StepGraph>(m, "StepGraph",
                        "A recorded sequence of dispatcher calls replayed from C++ (see pagellm.step_graph).")
      .def(py::init<int64_t>(), py::arg("num_inputs"))
      .def("add_node", &add_node, py::arg("name"), py::arg("overload"), py::arg("args"), py::arg("outputs"),
           "Append a call; args are descriptors in schema order; outputs are (return index, element or -1, slot).")
      .def("finalize", &StepGraph::finalize, py::arg("output_slots"))
      .def("run", &StepGraph::run, py::arg("inputs"), py::call_guard<py::gil_scoped_release>(),
           "Replay on new inputs (same shapes and dtypes as at capture); returns the output tensors.")
      .def_property_readonly("num_nodes", &StepGraph::num_nodes)
      .def_property_readonly("num_inputs", &StepGraph::num_inputs)
      .def_property_readonly("num_slots", &StepGraph::num_slots);
}

}  // namespace pagellm
