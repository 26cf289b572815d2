// Launcher of the portable sparse main-attention forward (key-block-outer, see
// sparse_kernel.cuh), explicitly instantiated per dtype (sparse_bf16.cu, sparse_fp16.cu) for
// D in {32, 64, 128}. One launch covers one token chunk. The Hopper kernel
// (forward/sm90/sparse_sm90.h) takes the same parameters and writes the same partials.
#pragma once

#include <cuda_runtime.h>

#include "cuda/forward/sparse_params.h"

namespace flash_msa::cuda::portable {

template <class T, int kD>
void launch_sparse_forward(const SparseForwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::portable
