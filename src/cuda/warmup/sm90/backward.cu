// Hopper dense (warmup) backward instantiations (D = Dp = 128).
#include "cuda/warmup/sm90/backward_kernel.cuh"

namespace flash_msa::cuda::sm90 {

template void launch_dense_backward<__nv_bfloat16>(const DenseBackwardParams&, cudaStream_t);
template void launch_dense_backward<__half>(const DenseBackwardParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm90
