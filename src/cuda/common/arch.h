// Which chip-specific kernels a launch may use.
#pragma once

namespace flash_msa::cuda {

// True when `kernel` (a __global__ function of a Hopper-only path) can run on the current
// device: compute capability 9.x, the binary holds sm_90 code for it, and the environment
// variable FLASH_MSA_PORTABLE_KERNELS is unset or "0" (set it to run the portable mma.sync
// kernels everywhere, e.g. to test them on a Hopper GPU). No device synchronisation.
bool hopper_kernels_usable(const void* kernel);

}  // namespace flash_msa::cuda
