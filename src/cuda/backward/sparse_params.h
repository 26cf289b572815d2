// Contract of the sparse backward that the portable kernel (portable/) and the Hopper kernel
// (sm90/) share: their parameters and the numbering of their partials.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/shape.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::portable {

struct SparseBackwardParams {
  ConstView q;     // [B, H, S, D] strided, 16-byte aligned rows (likewise k, v, dout)
  ConstView k;     // [B, Hk, S, D]
  ConstView v;     // [B, Hk, S, D]; unused in teacher mode
  ConstView dout;  // [B, H, S, D]; unused in teacher mode
  schedule::Index index;
  schedule::Items items;
  const float* lse;    // [B, H, S] natural log, from the forward
  const float* delta;  // [B, H, S] <out, dout>; unused in teacher mode
  void* dq_part;       // [chunk edges, G, D] dtype, dS K of the block (unscaled), rows in
                       // fragment order (mma_sm80.cuh); unused in teacher mode
  float* teacher;      // [chunk edges, 128] mean over the group's heads of P; null: not needed
  float* dk_part;      // [items, 128, D] dS^T Q of the item (unscaled); unused in teacher mode
  float* dv_part;      // [items, 128, D] P^T dO of the item; unused in teacher mode
  KernelShape shape;
  Chunk chunk;
};

}  // namespace flash_msa::cuda::portable
