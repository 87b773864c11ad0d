// The shared-memory all-reduce's Python face: pagellm.distributed.shm_comm wraps it for the TP group.
#include "bindings/py_shm_comm.h"

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/comm/shm_allreduce.h"

namespace py = pybind11;

namespace pagellm {
namespace {

ShmDtype shm_dtype_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return ShmDtype::kFloat32;
    case at::kBFloat16: return ShmDtype::kBFloat16;
    case at::kHalf: return ShmDtype::kFloat16;
    default:
      throw py::type_error(std::string("ShmAllReduce.all_reduce: dtype must be float32, bfloat16 or float16, got ") +
                           c10::toString(x.scalar_type()));
  }
}

void all_reduce_tensor(ShmAllReduce& comm, at::Tensor& x) {
  const ShmDtype dtype = shm_dtype_of(x);
  if (!x.device().is_cpu()) throw py::value_error("ShmAllReduce.all_reduce: the tensor must be on the CPU, got " + x.device().str());
  if (!x.is_contiguous()) throw py::value_error("ShmAllReduce.all_reduce: the tensor must be contiguous");
  void* data = x.data_ptr();
  const int64_t numel = x.numel();
  py::gil_scoped_release release;  // a wait may sleep; other Python threads (ranks in a test) run meanwhile
  comm.all_reduce(data, numel, dtype);
}

// out [world, *x.shape] = every rank's x in rank order (any dtype: the bytes are copied).
at::Tensor all_gather_tensor(ShmAllReduce& comm, const at::Tensor& x) {
  if (!x.device().is_cpu())
    throw py::value_error("ShmAllReduce.all_gather: the tensor must be on the CPU, got " + x.device().str());
  const at::Tensor src = x.contiguous();
  std::vector<int64_t> shape{comm.world_size()};
  shape.insert(shape.end(), src.sizes().begin(), src.sizes().end());
  at::Tensor out = at::empty(shape, src.options());
  const void* in = src.data_ptr();
  void* dst = out.data_ptr();
  const int64_t nbytes = src.numel() * static_cast<int64_t>(src.element_size());
  py::gil_scoped_release release;
  comm.all_gather(in, dst, nbytes);
  return out;
}

}  // namespace

void init_shm_comm_bindings(py::module_& m) {
  py::class_<ShmAllReduce, std::unique_ptr<ShmAllReduce>>(
      m, "ShmAllReduce",
      "An all-reduce over the ranks of one host through a POSIX shared-memory segment (rank 0 creates `name`, "
      "the others attach; the name is unlinked once all attached). Sums in rank order: every rank gets the "
      "same bits.")
      .def(py::init([](const std::string& name, int rank, int world_size, int64_t slot_bytes, double timeout_s,
                       int spin_us) {
             ShmAllReduceOptions options;
             options.slot_bytes = slot_bytes;
             options.timeout_s = timeout_s;
             options.spin_us = spin_us;
             py::gil_scoped_release release;  // attaching waits for rank 0
             return std::make_unique<ShmAllReduce>(name, rank, world_size, options);
           }),
           py::arg("name"), py::arg("rank"), py::arg("world_size"),
           py::arg("slot_bytes") = ShmAllReduceOptions{}.slot_bytes,
           py::arg("timeout_s") = ShmAllReduceOptions{}.timeout_s, py::arg("spin_us") = ShmAllReduceOptions{}.spin_us)
      .def("all_reduce", &all_reduce_tensor, py::arg("x"),
           "In place: x (contiguous CPU float32 / bfloat16 / float16, any shape) becomes the sum over the ranks "
           "(fp32 accumulation). RuntimeError naming the rank when a peer is gone or slower than timeout_s.")
      .def("all_gather", &all_gather_tensor, py::arg("x"),
           "[world_size, *x.shape]: every rank's x (CPU, any dtype, same shape on every rank) in rank order. "
           "Shares the all-reduce's rounds: every rank must issue the same sequence of calls.")
      .def_property_readonly("rank", &ShmAllReduce::rank)
      .def_property_readonly("world_size", &ShmAllReduce::world_size)
      .def_property_readonly("slot_bytes", &ShmAllReduce::slot_bytes)
      .def_property_readonly("name", &ShmAllReduce::name)
      .def_property_readonly("all_attached", &ShmAllReduce::all_attached);
  m.def("shm_unlink", &ShmAllReduce::unlink, py::arg("name"),
        "Removes a shared-memory segment's name (no error when it is already gone).");
}

}  // namespace pagellm
