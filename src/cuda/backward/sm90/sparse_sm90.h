// Launcher of the Hopper sparse backward (sparse_kernel.cuh), instantiated per dtype (sparse.cu)
// for D = 128. Takes the portable kernel's parameters (gradient mode) and writes the same
// partials.
#pragma once

#include <cuda_runtime.h>

#include "cuda/backward/sm80/sparse_sm80.h"
#include "cuda/common/arch.h"

namespace flash_msa::cuda::sm90 {

// Launches the backward of one chunk and returns true when the Hopper kernel can run here
// (hopper_kernels_usable); returns false otherwise, launching nothing.
template <class T>
bool launch_sparse_backward(const sm80::SparseBackwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
