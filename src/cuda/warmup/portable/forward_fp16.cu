// Forward kernel instantiations for fp16 inputs, one per supported (D, Dp) pair.
#include "cuda/forward/sm80/forward_kernel.cuh"

namespace flash_msa::cuda::sm80 {

template void launch_forward<__half, 32, 32>(const ForwardKernelParams&, cudaStream_t);
template void launch_forward<__half, 64, 32>(const ForwardKernelParams&, cudaStream_t);
template void launch_forward<__half, 64, 64>(const ForwardKernelParams&, cudaStream_t);
template void launch_forward<__half, 128, 64>(const ForwardKernelParams&, cudaStream_t);
template void launch_forward<__half, 128, 128>(const ForwardKernelParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm80
