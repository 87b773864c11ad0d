// The element types the CUDA launchers accept, named without torch (the glue maps at::ScalarType to these).
#pragma once

namespace pagellm::cuda {
enum class DType { kFloat32, kFloat16, kBFloat16 };
}  // namespace pagellm::cuda
