// Hopper sparse forward instantiations (D = 128) and the probe of their sm_90a code.
#include "cuda/forward/sm90/sparse_kernel.cuh"

namespace flash_msa::cuda::sm90 {

template void launch_sparse_forward<__nv_bfloat16>(const portable::SparseForwardParams&,
                                                   cudaStream_t);
template void launch_sparse_forward<__half>(const portable::SparseForwardParams&, cudaStream_t);

bool sparse_forward_built() {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, sparse_forward::forward_kernel<__nv_bfloat16, false>) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion == 90;
}

}  // namespace flash_msa::cuda::sm90
