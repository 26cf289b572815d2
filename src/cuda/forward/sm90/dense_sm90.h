// Parameters and launcher of the Hopper (wgmma) dense query-outer forward (dense_kernel.cuh: out,
// lse and the proxy lse), D = Dp = 128, any G, instantiated per dtype (dense.cu). Two callers: the
// sparse forward (forward/forward.cu) launches it for its tile path over listed blocks, and the
// host entry of warmup mode (warmup/warmup.cu) over every visible block where warmup_kernels()
// says kHopper.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/shape.h"
#include "cuda/host/impl.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm90 {

// What the kernel takes; the host's choice (host/variants.cu) reads it.
inline constexpr char kDenseForwardTakes[] = "D = Dp = 128";
inline bool dense_forward_takes(const Problem& pr) {
  return pr.head_dim == 128 && pr.proxy_head_dim == 128;
}

struct DenseForwardParams {
  ConstView q;               // [B, H, Sq, D] strided, 16-byte aligned rows (likewise every view)
  ConstView k;               // [B, Hk, S, D]
  ConstView v;               // [B, Hk, S, D]
  ConstView qp;              // [B, Hp, Sq, Dp]
  ConstView kp;              // [B, Hpk, S, Dp]
  MutView out;               // [B, H, Sq, D]
  float* lse;                // [B, H, Sq] contiguous, natural log
  float* lse_proxy;          // [B, Hp, Sq] contiguous, natural log
  const int32_t* doc_start;  // [B * S] first token of each token's document; null: one per row
  schedule::Tiles tiles;     // the sparse forward's tile path: the listed tiles, each walking
                             // its blocks (top_k of the shape: their row length); all null in
                             // warmup (every visible block)
  KernelShape shape;
};

template <class T>
void launch_dense_forward(const DenseForwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
