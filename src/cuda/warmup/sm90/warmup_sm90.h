// Parameters and launcher of the Hopper (wgmma) dense backward of warmup mode (SPEC section 5),
// D = Dp = 128, any G (backward_kernel.cuh: the main gradients, the teacher, the KL terms and the
// proxy gradients in one key-outer pass), instantiated per dtype (backward.cu). The host entry
// (warmup/warmup.cu) launches it where warmup_kernels() says kHopper; warmup's forward is the
// dense forward of forward/sm90/dense_sm90.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/shape.h"
#include "cuda/host/impl.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm90 {

// What the kernel takes; the host's choice (host/variants.cu) reads it.
inline constexpr char kWarmupBackwardTakes[] = "D = Dp = 128";
inline bool warmup_backward_takes(const Problem& pr) {
  return pr.head_dim == 128 && pr.proxy_head_dim == 128;
}

// Query rows of a chunk of the dense backward (its tiles, counters and accumulator tiles).
inline constexpr int kDenseChunkRows = 64;

struct DenseBackwardParams {
  ConstView q;               // [B, H, Sq, D] strided, 16-byte aligned rows (likewise every view)
  ConstView k;               // [B, Hk, S, D]
  ConstView v;               // [B, Hk, S, D]
  ConstView qp;              // [B, Hp, Sq, Dp]
  ConstView kp;              // [B, Hpk, S, Dp]
  ConstView dout;            // [B, H, Sq, D]
  const float* lse;          // [B, H, Sq] contiguous, natural log
  const float* lse_proxy;    // [B, Hp, Sq] contiguous, natural log
  const float* delta;        // [B, H, Sq] <out, dout>
  const float* kl_grad;      // [1] upstream gradient w of kl; null: w = 0
  const int32_t* doc_start;  // [B * S]; null: one document per row
  float* dq_acc;             // [B, H, Sq, D] zeroed: sum over key blocks of dS K (unscaled);
                             // row i's columns permuted, column j at j ^ 8 (i % 8)
  float* dqp_acc;            // [B, Hp, Sq, Dp] zeroed: sum over key blocks of g Kp (unscaled),
                             // permuted as dq_acc
  float* dk_part;            // [B, Hp, S, D]: dS^T Q (unscaled) of the heads of one proxy group
  float* dv_part;            // [B, Hp, S, D]: P^T dO of the heads of one proxy group
  float* dkp_part;           // [B, Hp, S, Dp] zeroed: g^T Qp (unscaled) of one proxy head
  float* kl_part;            // [B * Hp * NB]: KL terms of each key block's CTA
  int32_t* order;            // [B * Hp * ceil(Sq / kDenseChunkRows) * (G + 1) + 1] zeroed: per
                             // query chunk and slot (G heads, proxy) the key blocks done with
                             // it; last: the CTAs' ticket counter
  KernelShape shape;
};

template <class T>
void launch_dense_backward(const DenseBackwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
