// Sparse forward and merge instantiations for fp16 inputs, one per head dim.
#include "cuda/forward/sm80/merge_kernel.cuh"
#include "cuda/forward/sm80/sparse_kernel.cuh"

namespace flash_msa::cuda::sm80 {

#define FLASH_MSA_INSTANTIATE(D)                                                        \
  template void launch_sparse_forward<__half, D>(const SparseForwardParams&, cudaStream_t); \
  template void launch_merge<__half, D>(const MergeParams&, cudaStream_t);
FLASH_MSA_INSTANTIATE(32)
FLASH_MSA_INSTANTIATE(64)
FLASH_MSA_INSTANTIATE(128)
#undef FLASH_MSA_INSTANTIATE

}  // namespace flash_msa::cuda::sm80
