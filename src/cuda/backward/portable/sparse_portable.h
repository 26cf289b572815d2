// Parameters and launcher of the portable sparse backward (key-block-outer, see
// sparse_kernel.cuh), explicitly instantiated per dtype (sparse_bf16.cu, sparse_fp16.cu) for
// D in {32, 64, 128}; its teacher-only mode serves the forward's KL value (passes/teacher.cu).
// One launch covers one token chunk; edges and items are numbered as in the forward
// (forward/portable/sparse_portable.h). The Hopper kernel (backward/sm90/sparse_sm90.h) takes
// the same parameters and writes the same partials.
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

// kTeacherOnly: only P and the teacher rows (the KL value of the forward needs them).
template <class T, int kD, bool kTeacherOnly>
void launch_sparse_backward(const SparseBackwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::portable
