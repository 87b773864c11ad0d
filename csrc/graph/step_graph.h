// StepGraph: a recorded sequence of dispatcher calls (aten and torch.ops.pagellm ops) replayed from C++.
//
// The CPU analogue of a CUDA graph. Python records one step of the model's own forward under a
// TorchDispatchMode (pagellm/step_graph/recorder.py), then hands the calls here: each node is an operator
// handle plus, for every schema argument, where its value comes from (a constant fixed at capture: a
// weight, a KV-cache tensor, a size, a dtype; or a value slot: a step input or an earlier node's output).
// run() feeds new inputs into the input slots and calls the operators in order through the dispatcher,
// without Python in between. Intermediates are allocated by the ops as in eager mode and dropped after
// their last use, so memory behaves as in eager mode.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pagellm::graph {

// Where one argument's value comes from.
struct ArgSource {
  enum class Kind { kConstant, kSlot, kList };
  Kind kind = Kind::kConstant;
  c10::IValue constant;               // kConstant
  int64_t slot = -1;                  // kSlot
  std::vector<ArgSource> elements;    // kList: a Tensor[] / Tensor?[] whose elements mix slots and constants
  c10::TypePtr list_type;             // kList: the schema type, to build the right list kind
};

// One output tensor of a node: element `element` (-1: the return itself) of return `index` -> `slot`.
struct OutputTarget {
  int64_t index = 0;
  int64_t element = -1;
  int64_t slot = -1;
};

struct Node {
  c10::OperatorHandle op;
  std::vector<ArgSource> args;
  std::vector<OutputTarget> outputs;
  std::vector<int64_t> release;  // slots whose last use is this node
  bool reuse_empty = false;      // an all-constant aten::empty whose result may be kept between replays
  at::Tensor kept;               // that result, from the last replay
};

class StepGraph {
 public:
  // A graph whose slots 0..num_inputs-1 are the step inputs given to run().
  explicit StepGraph(int64_t num_inputs);
  // Appends a call of `name`.`overload` (e.g. "aten::view", "default" or ""); args in schema order.
  // Throws std::invalid_argument for an unknown operator or an argument count that does not match.
  void add_node(const std::string& name, const std::string& overload, std::vector<ArgSource> args,
                std::vector<OutputTarget> outputs);
  // The slots run() returns; computes each slot's last use. No node may be added afterwards.
  void finalize(std::vector<int64_t> output_slots);
  // Replays the graph on new inputs (shapes and dtypes as at capture). Returns the output tensors.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs);
  // The schema of an operator, for argument conversion; throws std::invalid_argument if unknown.
  static const c10::FunctionSchema& schema_of(const std::string& name, const std::string& overload);

  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size()); }
  int64_t num_inputs() const { return num_inputs_; }
  int64_t num_slots() const { return num_slots_; }

 private:
  // Bytes of `aten::empty` results a graph keeps between replays (a batch-1 step's intermediates are a few
  // KiB each; the dispatcher call to allocate one cost about as much as a small kernel's whole call).
  static constexpr int64_t kKeptEmptyBytes = int64_t{1} << 20;

  // Marks the all-constant aten::empty nodes whose result is no graph output, up to kKeptEmptyBytes.
  void mark_reusable_empties();
  // Runs one node: a kept empty tensor nobody else references is reused, anything else is called.
  void run_node(Node& node, torch::jit::Stack& stack);
  // Pushes one argument's value onto the stack.
  void push(const ArgSource& a, torch::jit::Stack& stack) const;

  int64_t num_inputs_;
  int64_t num_slots_;
  bool finalized_ = false;
  std::vector<Node> nodes_;
  std::vector<int64_t> output_slots_;
  std::vector<at::Tensor> values_;
  int64_t kept_bytes_ = 0;  // bytes held in Node::kept
};

}  // namespace pagellm::graph
