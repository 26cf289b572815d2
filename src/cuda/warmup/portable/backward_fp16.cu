// Explicit instantiations of the portable backward for fp16 and the supported (D, Dp) pairs.
#include "cuda/backward/sm80/backward_launch.cuh"

namespace flash_msa::cuda::sm80 {

template void launch_backward<__half, 32, 32>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__half, 64, 32>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__half, 64, 64>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__half, 128, 64>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__half, 128, 128>(const BackwardKernelParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm80
