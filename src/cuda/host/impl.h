// Which implementation runs the sparse main kernels and select, and the launch of a kernel with
// a large dynamic shared-memory plan. The choice is made once per call by the host entries and
// is the one flash_msa::cuda::sparse_kernels and select_kernels report (cuda.h); what it reads
// of the device is probed once per device and cached, so launches do no device queries.
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
