// Parameters and launcher of the portable proxy-branch kernel over the selected blocks (SPEC
// section 3 and the proxy half of section 4), key-block-outer on the schedule's work items like
// the main kernels; explicitly instantiated per dtype (proxy_bf16.cu, proxy_fp16.cu) for Dp in
// {32, 64, 128}. Edges and items are numbered as in forward/sparse_params.h.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/shape.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::portable {

enum class ProxyMode {
  kLse,   // forward: log-sum-exp of each edge's proxy scores (merged into lse_proxy)
  kKl,    // forward, KL value: sum over the block of t (log t - log pp) per edge
  kGrad,  // backward: g = w (pp - t) / (B Hp S); g Kp per edge, g^T Qp per item
};

struct ProxyParams {
  ConstView qp;  // [B, Hp, S, Dp] strided, 16-byte aligned rows
  ConstView kp;  // [B, Hpk, S, Dp] strided, 16-byte aligned rows
  schedule::Index index;
  schedule::Items items;
  const float* lse_proxy;  // [B, Hp, S] natural log (kKl, kGrad)
  const float* teacher;    // [chunk edges, 128] from the teacher pass or the main backward
                           // kernel (kKl, kGrad)
  const float* kl_grad;    // [1] upstream gradient w of kl (kGrad); null: w = 0
  float* lse_p_part;       // [chunk edges] log2 domain (kLse)
  float* kl_part;          // [chunk edges] (kKl; kGrad where the backward computes the value)
  float* dqp_part;         // [chunk edges, Dp] g Kp, unscaled, fragment order (kGrad)
  float* dkp_part;         // [items, 128, Dp] g^T Qp, unscaled (kGrad)
  KernelShape shape;
  Chunk chunk;
};

template <class T, int kDp, ProxyMode kMode>
void launch_proxy(const ProxyParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::portable
