// The gated activations fused_moe accepts, named without torch (shared by the CPU kernels, the CUDA
// launchers and the argument checks).
#pragma once

namespace pagellm {

// act(gate) * up: kSilu = SwiGLU (silu), kGeluTanh = GeGLU with the tanh approximation of gelu.
enum class MoeActivation { kSilu, kGeluTanh };

}  // namespace pagellm
