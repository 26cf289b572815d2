// Launcher of the Hopper sparse forward (sparse_kernel.cuh), instantiated per dtype
// (sparse.cu) for D = 128. Takes the portable kernel's parameters and writes the same partials.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/arch.h"
#include "cuda/forward/sm80/sparse_sm80.h"

namespace flash_msa::cuda::sm90 {

// Launches the forward of one chunk and returns true when the Hopper kernel can run here
// (hopper_kernels_usable); returns false otherwise, launching nothing.
template <class T>
bool launch_sparse_forward(const sm80::SparseForwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
