// Select kernel instantiations for fp16 inputs, one per supported proxy head dim.
#include "cuda/select/sm80/select_kernel.cuh"

namespace flash_msa::cuda::sm80 {

template void launch_select<__half, 32>(const SelectKernelParams&, cudaStream_t);
template void launch_select<__half, 64>(const SelectKernelParams&, cudaStream_t);
template void launch_select<__half, 128>(const SelectKernelParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm80
