// Hopper proxy-select instantiations (Dp = 64, 128; FP8 at 128), the FP8 quantisation and the
// probe of their sm_90a code.
#include "cuda/select/sm90/quantize.cuh"
#include "cuda/select/sm90/select_kernel.cuh"

namespace flash_msa::cuda::sm90 {

template void launch_select<__nv_bfloat16, 64>(const portable::SelectKernelParams&, cudaStream_t);
template void launch_select<__nv_bfloat16, 128>(const portable::SelectKernelParams&, cudaStream_t);
template void launch_select<__half, 64>(const portable::SelectKernelParams&, cudaStream_t);
template void launch_select<__half, 128>(const portable::SelectKernelParams&, cudaStream_t);
template void launch_select<__nv_fp8_e4m3, 128>(const portable::SelectKernelParams&, cudaStream_t);
template void launch_quantize<__nv_bfloat16>(const QuantizeParams&, cudaStream_t);
template void launch_quantize<__half>(const QuantizeParams&, cudaStream_t);

bool select_built() {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, block_select::select_kernel<__nv_bfloat16, 128>) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion == 90;
}

}  // namespace flash_msa::cuda::sm90
