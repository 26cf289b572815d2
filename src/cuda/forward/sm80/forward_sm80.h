// Kernel-private parameters of the portable dense (warmup) main-attention forward and its
// launchers, explicitly instantiated per dtype (forward_bf16.cu, forward_fp16.cu) for the
// supported (D, Dp) pairs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm80 {

struct ForwardKernelParams {
  const void* q;  // [B, H, S, D] strided
  int64_t q_stride_b, q_stride_h, q_stride_s;
  const void* k;  // [B, Hk, S, D] strided, 16-byte aligned rows
  int64_t k_stride_b, k_stride_h, k_stride_s;
  const void* v;  // [B, Hk, S, D] strided, 16-byte aligned rows
  int64_t v_stride_b, v_stride_h, v_stride_s;
  const void* qp;  // [B, Hp, S, Dp] strided
  int64_t qp_stride_b, qp_stride_h, qp_stride_s;
  const void* kp;  // [B, Hpk, S, Dp] strided, 16-byte aligned rows
  int64_t kp_stride_b, kp_stride_h, kp_stride_s;
  void* out;  // [B, H, S, D] strided
  int64_t out_stride_b, out_stride_h, out_stride_s;
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
