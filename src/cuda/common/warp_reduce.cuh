// Reductions across the 4 lanes of an mma quad (lanes 4r .. 4r + 3 hold one accumulator row).
// Every lane of the warp must call them.
#pragma once

namespace flash_msa::cuda {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace flash_msa::cuda
