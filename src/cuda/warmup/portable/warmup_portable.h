// Parameters and launchers of the portable dense (warmup) kernels of MSA, query-outer: the
// forward (forward_kernel.cuh) and the backward (backward_kernel.cuh), explicitly instantiated
// per dtype (forward_*.cu, backward_*.cu) for the supported (D, Dp) pairs. Warmup runs both
// branches over every visible key (SPEC section 5).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common/shape.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::portable {

// G = H / Hp main heads per proxy head share one 16-row MMA tile.
inline constexpr int kMaxGroup = 16;

struct ForwardKernelParams {
  ConstView q;                // [B, H, S, D] strided, 16-byte aligned rows (likewise every view)
  ConstView k;                // [B, Hk, S, D]
  ConstView v;                // [B, Hk, S, D]
  ConstView qp;               // [B, Hp, S, Dp]
  ConstView kp;               // [B, Hpk, S, Dp]
  MutView out;                // [B, H, S, D]
  float* lse;                 // [B, H, S] contiguous
  float* lse_proxy;           // [B, Hp, S] contiguous
  float* kl_partial;          // [B, Hp, S] per-(query, proxy head) KL terms; null: no KL pass
  const int32_t* cu_seqlens;  // [num_docs + 1] offsets over B*S tokens; null: one doc per row
  KernelShape shape;
};

struct BackwardKernelParams {
  ConstView q;                // [B, H, S, D] strided, 16-byte aligned rows (likewise every view)
  ConstView k;                // [B, Hk, S, D]
  ConstView v;                // [B, Hk, S, D]
  ConstView qp;               // [B, Hp, S, Dp]
  ConstView kp;               // [B, Hpk, S, Dp]
  ConstView out;              // [B, H, S, D]
  ConstView dout;             // [B, H, S, D]
  MutView dq;                 // [B, H, S, D]
  MutView dqp;                // [B, Hp, S, Dp]
  MutView dk;                 // [B, Hk, S, D]
  MutView dv;                 // [B, Hk, S, D]
  MutView dkp;                // [B, Hpk, S, Dp]
  const float* lse;           // [B, H, S] contiguous
  const float* lse_proxy;     // [B, Hp, S] contiguous
  const float* kl_grad;       // [1] upstream gradient w of kl; null: w = 0
  const int32_t* cu_seqlens;  // [num_docs + 1] offsets over B*S tokens; null: one doc per row
  float* delta;               // workspace [B, H, S]: <out, dout> per (head, token)
  float* dk_part;             // workspace [B, Hp, S, D]: dk of the heads of one proxy group
  float* dv_part;             // workspace [B, Hp, S, D]
  float* dkp_part;            // workspace [B, Hp, S, Dp]: dkp from one proxy head
  float* kl_rows;             // workspace [B, Hp, S]: KL term per (query, proxy head); null: none
  KernelShape shape;
};

template <class T, int kD, int kDp>
void launch_forward(const ForwardKernelParams& params, cudaStream_t stream);

// Delta, dq/dqp (query-outer), dk/dv/dkp partials per proxy head (key-outer), and the
// fixed-order reduction of the partials into the outputs.
template <class T, int kD, int kDp>
void launch_backward(const BackwardKernelParams& params, cudaStream_t stream);

// The last of those steps alone: dk, dv, dkp = the fixed-order sums of the per-proxy-head
// partials dk_part, dv_part, dkp_part (scaled already), in the dtype. The Hopper backward
// (warmup/sm90) writes the same partials.
template <class T, int kD, int kDp>
void launch_backward_reduce(const BackwardKernelParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::portable
