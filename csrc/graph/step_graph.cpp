#include "graph/step_graph.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace pagellm::graph {

StepGraph::StepGraph(int64_t num_inputs) : num_inputs_(num_inputs), num_slots_(num_inputs) {
  if (num_inputs < 0) throw std::invalid_argument("num_inputs must be >= 0");
}

const c10::FunctionSchema& StepGraph::schema_of(const std::string& name, const std::string& overload) {
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op.has_value()) throw std::invalid_argument("unknown operator " + name + "." + overload);
  return op->schema();
}

namespace {
// Largest slot referenced by an argument, and the slots it reads.
void collect_slots(const ArgSource& a, std::vector<int64_t>& slots) {
  if (a.kind == ArgSource::Kind::kSlot) slots.push_back(a.slot);
  for (const ArgSource& e : a.elements) collect_slots(e, slots);
}
}  // namespace

void StepGraph::add_node(const std::string& name, const std::string& overload, std::vector<ArgSource> args,
                         std::vector<OutputTarget> outputs) {
  if (finalized_) throw std::logic_error("StepGraph::add_node after finalize()");
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op.has_value()) throw std::invalid_argument("unknown operator " + name + "." + overload);
  const auto& schema = op->schema();
  if (args.size() != schema.arguments().size()) {
    throw std::invalid_argument(name + "." + overload + " takes " + std::to_string(schema.arguments().size()) +
                                " arguments, got " + std::to_string(args.size()));
  }
  std::vector<int64_t> read;
  for (const ArgSource& a : args) collect_slots(a, read);
  for (int64_t s : read) {
    if (s < 0 || s >= num_slots_) throw std::invalid_argument(name + ": argument reads undefined slot " + std::to_string(s));
  }
  for (const OutputTarget& o : outputs) {
    if (o.index < 0 || o.index >= static_cast<int64_t>(schema.returns().size())) {
      throw std::invalid_argument(name + ": output index " + std::to_string(o.index) + " out of range");
    }
    if (o.slot != num_slots_) throw std::invalid_argument("output slots must be numbered in order of creation");
    ++num_slots_;
  }
  nodes_.push_back(Node{*op, std::move(args), std::move(outputs), {}});
}

void StepGraph::finalize(std::vector<int64_t> output_slots) {
  if (finalized_) throw std::logic_error("StepGraph::finalize called twice");
  for (int64_t s : output_slots) {
    if (s < 0 || s >= num_slots_) throw std::invalid_argument("output slot " + std::to_string(s) + " is undefined");
  }
  // Last reader of every slot; a slot that is an output (or never read) is kept to the end.
  std::vector<int64_t> last_use(static_cast<size_t>(num_slots_), -1);
  for (size_t n = 0; n < nodes_.size(); ++n) {
    std::vector<int64_t> read;
    for (const ArgSource& a : nodes_[n].args) collect_slots(a, read);
    for (int64_t s : read) last_use[static_cast<size_t>(s)] = static_cast<int64_t>(n);
  }
  for (int64_t s : output_slots) last_use[static_cast<size_t>(s)] = -1;
  for (int64_t s = 0; s < num_slots_; ++s) {
    const int64_t n = last_use[static_cast<size_t>(s)];
    if (n >= 0) nodes_[static_cast<size_t>(n)].release.push_back(s);
  }
  output_slots_ = std::move(output_slots);
  values_.assign(static_cast<size_t>(num_slots_), at::Tensor());
  mark_reusable_empties();
  finalized_ = true;
}

void StepGraph::mark_reusable_empties() {
  std::vector<bool> is_output(static_cast<size_t>(num_slots_), false);
  for (int64_t s : output_slots_) is_output[static_cast<size_t>(s)] = true;
  for (Node& node : nodes_) {
    const auto& name = node.op.schema().operator_name();
    if (name.name != "aten::empty" || name.overload_name != "memory_format" || node.outputs.size() != 1) continue;
    if (is_output[static_cast<size_t>(node.outputs[0].slot)]) continue;
    bool constant = true;
    for (const ArgSource& a : node.args) constant = constant && a.kind == ArgSource::Kind::kConstant;
    if (constant) node.reuse_empty = true;  // its size is known after the first call (run_node)
  }
}

void StepGraph::run_node(Node& node, torch::jit::Stack& stack) {
  // An empty tensor's contents are unspecified, so last replay's tensor serves again, provided no tensor
  // outside this graph shares its storage (a view of it returned to the caller, say).
  const at::Tensor& kept = node.kept;
  if (kept.defined() && kept.use_count() == 1 && kept.storage().use_count() == 1) {
    values_[static_cast<size_t>(node.outputs[0].slot)] = kept;
    return;
  }
  stack.clear();
  for (const ArgSource& a : node.args) push(a, stack);
  node.op.callBoxed(stack);
  for (const OutputTarget& o : node.outputs) {
    c10::IValue& ret = stack[static_cast<size_t>(o.index)];
    values_[static_cast<size_t>(o.slot)] = o.element < 0 ? ret.toTensor() : ret.toTensorList().get(o.element);
  }
  if (node.reuse_empty && !node.kept.defined()) {
    const at::Tensor& t = values_[static_cast<size_t>(node.outputs[0].slot)];
    const int64_t nbytes = static_cast<int64_t>(t.nbytes());
    if (kept_bytes_ + nbytes <= kKeptEmptyBytes) {
      node.kept = t;
      kept_bytes_ += nbytes;
    } else {
      node.reuse_empty = false;
    }
  } else if (node.reuse_empty) {
    node.kept = values_[static_cast<size_t>(node.outputs[0].slot)];  // the old one is still referenced elsewhere
  }
}

void StepGraph::push(const ArgSource& a, torch::jit::Stack& stack) const {
  switch (a.kind) {
    case ArgSource::Kind::kConstant:
      stack.push_back(a.constant);
      return;
    case ArgSource::Kind::kSlot:
      stack.emplace_back(values_[static_cast<size_t>(a.slot)]);
      return;
    case ArgSource::Kind::kList: {
      torch::jit::Stack elems;
      for (const ArgSource& e : a.elements) push(e, elems);
      const c10::TypePtr elem = a.list_type->castRaw<c10::ListType>()->getElementType();
      if (elem->kind() == c10::TypeKind::TensorType) {
        c10::List<at::Tensor> list;
        list.reserve(elems.size());
        for (auto& v : elems) list.push_back(v.toTensor());
        stack.emplace_back(std::move(list));
      } else {
        c10::List<std::optional<at::Tensor>> list;
        list.reserve(elems.size());
        for (auto& v : elems) list.push_back(v.isNone() ? std::optional<at::Tensor>() : v.toTensor());
        stack.emplace_back(std::move(list));
      }
      return;
    }
  }
}

std::vector<at::Tensor> StepGraph::run(const std::vector<at::Tensor>& inputs) {
  if (!finalized_) throw std::logic_error("StepGraph::run before finalize()");
  if (static_cast<int64_t>(inputs.size()) != num_inputs_) {
    throw std::invalid_argument("StepGraph::run takes " + std::to_string(num_inputs_) + " inputs, got " +
                                std::to_string(inputs.size()));
  }
  std::copy(inputs.begin(), inputs.end(), values_.begin());
  torch::jit::Stack stack;
  for (Node& node : nodes_) {
    run_node(node, stack);
    for (int64_t s : node.release) values_[static_cast<size_t>(s)].reset();
  }
  std::vector<at::Tensor> out;
  out.reserve(output_slots_.size());
  for (int64_t s : output_slots_) out.push_back(values_[static_cast<size_t>(s)]);
  for (auto& v : values_) v.reset();
  return out;
}

}  // namespace pagellm::graph
