// Hopper sparse forward instantiations (D = 128).
#include "cuda/forward/sm90/sparse_kernel.cuh"

namespace flash_msa::cuda::sm90 {

template bool launch_sparse_forward<__nv_bfloat16>(const sm80::SparseForwardParams&, cudaStream_t);
template bool launch_sparse_forward<__half>(const sm80::SparseForwardParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm90
