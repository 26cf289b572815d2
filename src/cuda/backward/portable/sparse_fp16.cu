// Sparse backward instantiations for fp16 inputs, one per head dim and mode (gradients, or the
// teacher alone for the forward's KL value).
#include "cuda/backward/sm80/sparse_kernel.cuh"

namespace flash_msa::cuda::sm80 {

#define FLASH_MSA_INSTANTIATE(D)                                                                 \
  template void launch_sparse_backward<__half, D, false>(const SparseBackwardParams&, cudaStream_t); \
  template void launch_sparse_backward<__half, D, true>(const SparseBackwardParams&, cudaStream_t);
FLASH_MSA_INSTANTIATE(32)
FLASH_MSA_INSTANTIATE(64)
FLASH_MSA_INSTANTIATE(128)
#undef FLASH_MSA_INSTANTIATE

}  // namespace flash_msa::cuda::sm80
