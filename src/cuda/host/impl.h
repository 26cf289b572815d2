// Which chip-specific kernels a launch may use, and the launch of a Hopper-only kernel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/check.h"

namespace flash_msa::cuda {

// True when `kernel` (a __global__ function of a Hopper-only path) can run on the current
// device: compute capability 9.x, the binary holds sm_90 code for it, and the environment
// variable FLASH_MSA_PORTABLE_KERNELS is unset or "0" (set it to run the portable mma.sync
// kernels everywhere, e.g. to test them on a Hopper GPU). No device synchronisation.
bool hopper_kernels_usable(const void* kernel);

// Launches kernel<<<grid, threads, bytes of dynamic shared memory, stream>>>(params) when
// hopper_kernels_usable(kernel) and returns true; returns false, launching nothing, otherwise.
template <class Params>
bool launch_hopper(void (*kernel)(Params), unsigned grid, int threads, int bytes,
                   const Params& params, cudaStream_t stream) {
  if (!hopper_kernels_usable(reinterpret_cast<const void*>(kernel))) return false;
  FLASH_MSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<grid, threads, bytes, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
  return true;
}

}  // namespace flash_msa::cuda
