// Proxy-branch kernel instantiations for fp16 inputs, one per proxy head dim and mode.
#include "cuda/proxy/sm80/proxy_kernel.cuh"

namespace flash_msa::cuda::sm80 {

#define FLASH_MSA_INSTANTIATE(DP)                                                              \
  template void launch_proxy<__half, DP, ProxyMode::kLse>(const ProxyParams&, cudaStream_t);  \
  template void launch_proxy<__half, DP, ProxyMode::kKl>(const ProxyParams&, cudaStream_t);   \
  template void launch_proxy<__half, DP, ProxyMode::kGrad>(const ProxyParams&, cudaStream_t);
FLASH_MSA_INSTANTIATE(32)
FLASH_MSA_INSTANTIATE(64)
FLASH_MSA_INSTANTIATE(128)
#undef FLASH_MSA_INSTANTIATE

}  // namespace flash_msa::cuda::sm80
