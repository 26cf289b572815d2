// Launcher of the Hopper sparse backward (sparse_kernel.cuh), instantiated per dtype (sparse.cu)
// for D = 128. Takes the portable kernel's parameters (gradient mode) and writes the same
// partials; the host entry launches it where sparse_kernels() says kHopper (host/impl.h).
#pragma once

#include <cuda_runtime.h>

#include "cuda/backward/sparse_params.h"
#include "cuda/host/impl.h"

namespace flash_msa::cuda::sm90 {

// What the kernel takes; the host's choice (host/variants.cu) reads it.
inline constexpr char kSparseBackwardTakes[] = "D = 128";
inline bool sparse_backward_takes(const Problem& pr) { return pr.head_dim == 128; }

template <class T>
void launch_sparse_backward(const portable::SparseBackwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
