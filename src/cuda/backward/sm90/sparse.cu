// Hopper sparse backward instantiations (D = 128).
#include "cuda/backward/sm90/sparse_kernel.cuh"

namespace flash_msa::cuda::sm90 {

template bool launch_sparse_backward<__nv_bfloat16>(const sm80::SparseBackwardParams&,
                                                    cudaStream_t);
template bool launch_sparse_backward<__half>(const sm80::SparseBackwardParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm90
