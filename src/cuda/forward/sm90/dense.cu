// Hopper dense forward instantiations (D = Dp = 128) and the probe of the warmup
// kernels' sm_90a code.
#include "cuda/forward/sm90/dense_kernel.cuh"

namespace flash_msa::cuda::sm90 {

template void launch_dense_forward<__nv_bfloat16>(const DenseForwardParams&, cudaStream_t);
template void launch_dense_forward<__half>(const DenseForwardParams&, cudaStream_t);

bool warmup_built() {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, dense_forward::forward_kernel<__nv_bfloat16>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion == 90;
}

}  // namespace flash_msa::cuda::sm90
