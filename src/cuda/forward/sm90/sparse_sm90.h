// Launcher of the Hopper sparse forward (sparse_kernel.cuh), instantiated per dtype (sparse.cu)
// for D = 128. Takes the portable kernel's parameters and writes the same partials (and, when
// lse_p_part is set, the proxy branch's per-edge lse too); the host entry launches it where
// sparse_kernels() says kHopper (host/impl.h).
#pragma once

#include <cuda_runtime.h>

#include "cuda/forward/sparse_params.h"
#include "cuda/host/impl.h"

namespace flash_msa::cuda::sm90 {

template <class T>
void launch_sparse_forward(const portable::SparseForwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
