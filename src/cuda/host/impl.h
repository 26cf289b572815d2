// The Hopper kernels' probes of their sm_90a code (which host/variants.cu reads for the choice
// of each stage's kernels) and the launch of a kernel with a large dynamic shared-memory plan.
#pragma once

#include <cuda_runtime.h>

#include "cuda/host/check.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {

// The Hopper kernels' own probe (forward/sm90, backward/sm90, select/sm90, warmup/sm90): the
// binary holds sm_90a code for them (false when the build's architectures leave sm_90a out).
namespace sm90 {
bool sparse_forward_built();
bool sparse_backward_built();
bool select_built();
bool warmup_built();
}  // namespace sm90

// Launches kernel<<<grid, threads, bytes, stream>>>(params), first allowing `bytes` of dynamic
// shared memory (above the 48 KiB default).
template <class Params>
void launch_large_smem(void (*kernel)(Params), unsigned grid, int threads, int bytes,
                       const Params& params, cudaStream_t stream) {
  FLASH_MSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<grid, threads, bytes, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda
