// The decode kernels' in-kernel split merge (DecodeArgs::split_counters): where its counters live. Glue only
// (includes torch).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace pagellm::cuda {

// PAGELLM_CUDA_FUSE_DECODE_REDUCE: 1 (default) the decode kernels merge their flash-decoding splits themselves,
// 0 a second kernel does (the same bits); anything else raises. Read at every call, like the split grain: graphs
// captured after a change use the new value.
bool decode_merge_in_kernel();

// Counters for a decode launch on `like`'s device that needs `count` of them (decode_split_counter_count), all
// zero and left zero by every launch; nullptr (the launch merges its splits with the reduce kernel) when a
// CUDA-graph capture needs more counters than the device's buffer has (the buffer grows only outside captures).
// One buffer per device, never freed (a captured graph keeps the address it saw): decode launches on one device
// must not overlap in time, which holds for the engine's one stream.
int32_t* decode_split_counters(const at::Tensor& like, int64_t count);

}  // namespace pagellm::cuda
