// Raw-pointer launcher of the MLA decode (declared in attention_launch.h): the paged decode kernel with the
// latent cache as its one KV head, QK over all kMlaLatentDim dims, PV and the output over the first
// kMlaKvLoraRank. Its own file so the large instantiations compile in parallel with the others. Torch-free.
#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/decode_cuda.cuh"

namespace pagellm::cuda {

cudaError_t launch_paged_mla_decode(const DecodeArgs& a, DType dtype, cudaStream_t stream) {
  if (a.num_seqs == 0 || a.num_heads == 0) return cudaSuccess;
  if (a.num_kv_heads != 1 || a.head_dim != kMlaLatentDim || a.v_head_dim != kMlaKvLoraRank || a.window > 0 ||
      a.softcap > 0.f)
    return cudaErrorInvalidValue;
  if (const cudaError_t err = check_decode_launch(a); err != cudaSuccess) return err;
  switch (dtype) {
    case DType::kFloat32: return decode_typed<float, kMlaLatentDim, float, kMlaKvLoraRank>(a, stream);
    case DType::kFloat16: return decode_typed<__half, kMlaLatentDim, __half, kMlaKvLoraRank>(a, stream);
    case DType::kBFloat16:
      return decode_typed<__nv_bfloat16, kMlaLatentDim, __nv_bfloat16, kMlaKvLoraRank>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
