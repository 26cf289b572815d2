// Explicit instantiations of the portable backward for bf16 and the supported (D, Dp) pairs.
#include "cuda/backward/sm80/backward_launch.cuh"

namespace flash_msa::cuda::sm80 {

template void launch_backward<__nv_bfloat16, 32, 32>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 64, 32>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 64, 64>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 128, 64>(const BackwardKernelParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 128, 128>(const BackwardKernelParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm80
