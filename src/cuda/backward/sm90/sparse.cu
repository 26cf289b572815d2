// Hopper sparse backward instantiations (D = 128) and the probe of their sm_90a code.
#include "cuda/backward/sm90/sparse_kernel.cuh"

namespace flash_msa::cuda::sm90 {

template void launch_sparse_backward<__nv_bfloat16>(const portable::SparseBackwardParams&,
                                                    cudaStream_t);
template void launch_sparse_backward<__half>(const portable::SparseBackwardParams&, cudaStream_t);

bool sparse_backward_built() {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, sparse_backward::backward_kernel<__nv_bfloat16>) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion == 90;
}

}  // namespace flash_msa::cuda::sm90
