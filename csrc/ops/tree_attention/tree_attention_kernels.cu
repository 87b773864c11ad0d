// Raw-pointer launcher of the tree-attention kernel (declared in tree_attention_launch.h; the kernel is in
// tree_attention_cuda.cuh). Torch-free.
#include <cstdint>

#include "ops/tree_attention/tree_attention_cuda.cuh"
#include "ops/tree_attention/tree_attention_launch.h"

namespace pagellm::cuda {

cudaError_t launch_paged_tree_attention(const TreeAttentionArgs& a, DType dtype, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_heads == 0 || a.num_seqs == 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) return cudaErrorInvalidValue;
  switch (a.head_dim) {
    case 64: return tree_attention_dim<64>(a, dtype, stream);
    case 80: return tree_attention_dim<80>(a, dtype, stream);
    case 96: return tree_attention_dim<96>(a, dtype, stream);
    case 112: return tree_attention_dim<112>(a, dtype, stream);
    case 128: return tree_attention_dim<128>(a, dtype, stream);
    case 256: return tree_attention_dim<256>(a, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagellm::cuda
