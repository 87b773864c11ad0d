// The per-device counter buffers of the decode kernels' in-kernel split merge (split_counters_cuda.h).
#include "ops/paged_attention/split_counters_cuda.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "ops/cuda_common/torch_glue.h"

namespace pagellm::cuda {
namespace {
constexpr int64_t kMinCounters = 1 << 14;  // 64 KiB: 256 sequences of 64 head-group columns without growing
}  // namespace

bool decode_merge_in_kernel() {
  const char* env = std::getenv("PAGELLM_CUDA_FUSE_DECODE_REDUCE");
  if (env == nullptr || *env == '\0') return true;
  TORCH_CHECK(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0,
              "PAGELLM_CUDA_FUSE_DECODE_REDUCE must be 0 or 1, got '", env, "'");
  return env[0] == '1';
}

int32_t* decode_split_counters(const at::Tensor& like, int64_t count) {
  if (count <= 0) return nullptr;
  static std::mutex mu;
  // device -> buffers, newest last; never destroyed (a graph may hold any of them; no teardown-order hazard)
  static auto* buffers = new std::unordered_map<int, std::vector<at::Tensor>>();
  const std::lock_guard<std::mutex> lock(mu);
  std::vector<at::Tensor>& held = (*buffers)[like.get_device()];
  if (!held.empty() && held.back().numel() >= count) return held.back().data_ptr<int32_t>();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaStream_t stream = current_stream();
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone) return nullptr;
  int64_t n = kMinCounters;
  while (n < count) n *= 2;
  held.push_back(at::zeros({n}, like.options().dtype(at::kInt)));
  // zero before a launch on any stream reads them (a graph capture's stream is not this one)
  check_launch(cudaStreamSynchronize(stream), "decode split counters");
  return held.back().data_ptr<int32_t>();
}

}  // namespace pagellm::cuda
