// Kernel-private parameters of the portable dense (warmup) main-attention forward and its
// launchers, explicitly instantiated per dtype (forward_bf16.cu, forward_fp16.cu) for the
// supported (D, Dp) pairs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm80 {

struct ForwardKernelParams {
  ConstView q;                // [B, H, S, D] strided
  ConstView k;                // [B, Hk, S, D] strided, 16-byte aligned rows
  ConstView v;                // [B, Hk, S, D] strided, 16-byte aligned rows
  ConstView qp;               // [B, Hp, S, Dp] strided
  ConstView kp;               // [B, Hpk, S, Dp] strided, 16-byte aligned rows
  MutView out;                // [B, H, S, D] strided
  float* lse;                 // [B, H, S] contiguous
  float* lse_proxy;           // [B, Hp, S] contiguous
  float* kl_partial;          // [B, Hp, S] per-(query, proxy head) KL terms; null: no KL pass
  const int32_t* cu_seqlens;  // [num_docs + 1] offsets over B*S tokens; null: one doc per row
  int num_docs;
  int batch, seqlen, heads, proxy_heads;
  int group;               // G = H / Hp main heads per proxy head (<= 16: one 16-row MMA tile)
  int kv_group;            // H / Hk main heads per kv head
  int proxy_group;         // Hp / Hpk proxy heads per proxy key head
  float scale_log2;        // scale * log2(e)
  float proxy_scale_log2;  // proxy_scale * log2(e)
};

inline constexpr int kMaxGroup = 16;

template <class T, int kD, int kDp>
void launch_forward(const ForwardKernelParams& params, cudaStream_t stream);

// kl = sum(partial[0 .. n)) / n, in a fixed order (deterministic); one CTA.
void launch_kl_reduce(const float* partial, int64_t n, float* kl, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm80
