// Select kernel instantiations for bf16 inputs, one per supported proxy head dim.
#include "cuda/select/sm80/select_kernel.cuh"

namespace flash_msa::cuda::sm80 {

template void launch_select<__nv_bfloat16, 32>(const SelectKernelParams&, cudaStream_t);
template void launch_select<__nv_bfloat16, 64>(const SelectKernelParams&, cudaStream_t);
template void launch_select<__nv_bfloat16, 128>(const SelectKernelParams&, cudaStream_t);

}  // namespace flash_msa::cuda::sm80
