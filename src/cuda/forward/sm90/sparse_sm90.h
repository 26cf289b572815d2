// Launcher of the Hopper sparse forward (sparse_kernel.cuh), instantiated per dtype (sparse.cu)
// for D = 128. Takes the portable kernel's parameters and writes the same partials (and, when
// lse_p_part is set, the proxy branch's per-edge lse too); the host entry launches it where
// sparse_kernels() says kHopper (host/impl.h).
#pragma once

#include <cuda_runtime.h>

#include "cuda/forward/sparse_params.h"
#include "cuda/host/impl.h"

namespace flash_msa::cuda::sm90 {

// What the kernel takes; the host's choice (host/variants.cu) reads it. With Dp = 128 it also
// computes the proxy branch's per-edge lse (lse_p_part), else the proxy kernel does.
inline constexpr char kSparseForwardTakes[] = "D = 128";
inline bool sparse_forward_takes(const Problem& pr) { return pr.head_dim == 128; }
inline bool sparse_forward_takes_proxy(const Problem& pr) { return pr.proxy_head_dim == 128; }

template <class T>
void launch_sparse_forward(const portable::SparseForwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
