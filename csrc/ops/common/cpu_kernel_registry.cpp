#include "ops/common/cpu_kernel_registry.h"

#include <mutex>

namespace pagellm::cpu {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

CpuKernelLibrary& registered() {
  static CpuKernelLibrary library;
  return library;
}

}  // namespace

void register_cpu_kernel_library(const CpuKernelLibrary& library) noexcept {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registered() = library;
}

const CpuKernelLibrary* loaded_cpu_kernel_library() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return registered().isa == nullptr ? nullptr : &registered();
}

}  // namespace pagellm::cpu
