// Parameters and launcher of the portable sparse main-attention forward (key-block-outer, see
// sparse_kernel.cuh), explicitly instantiated per dtype (sparse_bf16.cu, sparse_fp16.cu) for
// D in {32, 64, 128}. One launch covers one token chunk. The Hopper kernel
// (forward/sm90/sparse_sm90.h) takes the same parameters and writes the same partials.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/shape.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::portable {

// Partial results of one edge (b, p, token, slot) of a chunk live at the chunk-local edge
// ce = ((b * Hp + p) * chunk.tokens + token - chunk.begin) * K + slot (schedule::chunk_edge).
struct SparseForwardParams {
  ConstView q;   // [B, H, S, D] strided, 16-byte aligned rows (likewise every view)
  ConstView k;   // [B, Hk, S, D]
  ConstView v;   // [B, Hk, S, D]
  ConstView qp;  // [B, Hp, S, Dp]
  ConstView kp;  // [B, Hpk, S, Dp]
  schedule::Index index;
  schedule::Items items;
  void* o_part;     // [chunk edges, G, D] dtype, normalised per block, rows in fragment order
  float* lse_part;  // [chunk edges, G] log2-domain log-sum-exp over the block's visible keys
  // The proxy branch's per-edge lse, which the Hopper kernel computes along (Dp = 128) in place
  // of the proxy kernel's kLse pass when set; the portable kernel leaves it.
  float* lse_p_part;  // [chunk edges] log2 domain, as ProxyParams::lse_p_part, or null
  KernelShape shape;
  Chunk chunk;
};

template <class T, int kD>
void launch_sparse_forward(const SparseForwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::portable
