// Contract of the sparse forward that the portable kernel (portable/) and the Hopper kernel
// (sm90/) share: their parameters and the numbering of their partials.
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

}  // namespace flash_msa::cuda::portable
