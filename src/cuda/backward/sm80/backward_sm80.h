// Kernel-private parameters of the portable dense (warmup) MSA backward and its launchers,
// explicitly instantiated per dtype (backward_bf16.cu, backward_fp16.cu) for the supported
// (D, Dp) pairs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm80 {

struct BackwardKernelParams {
  ConstView q;             // [B, H, S, D] strided, 16-byte aligned rows (likewise every view below)
  ConstView k;             // [B, Hk, S, D]
  ConstView v;             // [B, Hk, S, D]
  ConstView qp;            // [B, Hp, S, Dp]
  ConstView kp;            // [B, Hpk, S, Dp]
  ConstView out;           // [B, H, S, D]
  ConstView dout;          // [B, H, S, D]
  MutView dq;              // [B, H, S, D]
  MutView dqp;             // [B, Hp, S, Dp]
  MutView dk;              // [B, Hk, S, D]
  MutView dv;              // [B, Hk, S, D]
  MutView dkp;             // [B, Hpk, S, Dp]
  const float* lse;        // [B, H, S] contiguous
  const float* lse_proxy;  // [B, Hp, S] contiguous
  const float* kl_grad;    // [1] upstream gradient w of kl; null: w = 0
  const int32_t* cu_seqlens;  // [num_docs + 1] offsets over B*S tokens; null: one doc per row
  float* delta;               // workspace [B, H, S]: <out, dout> per (head, token)
  float* dk_part;             // workspace [B, Hp, S, D]: dk of the heads of one proxy group
  float* dv_part;             // workspace [B, Hp, S, D]
  float* dkp_part;            // workspace [B, Hp, S, Dp]: dkp from one proxy head
  int num_docs;
  int batch, seqlen, heads, proxy_heads;
  int group;          // G = H / Hp main heads per proxy head (<= 16: one 16-row MMA tile)
  int kv_group;       // H / Hk main heads per kv head
  int proxy_group;    // Hp / Hpk proxy heads per proxy key head
  int num_blocks;     // NB = ceil(S / 128)
  float scale;        // main softmax scale
  float proxy_scale;  // proxy score scale
  float inv_rows;     // 1 / (B * Hp * S), the KL mean
};

inline constexpr int kMaxGroup = 16;

// Workspace layout shared by the host sizing and the launch: fp32 arrays, each 256-byte aligned.
struct BackwardWorkspace {
  size_t delta, dk_part, dv_part, dkp_part, total;
};
BackwardWorkspace backward_workspace_layout(int64_t batch, int64_t heads, int64_t proxy_heads,
                                            int64_t seqlen, int64_t head_dim,
                                            int64_t proxy_head_dim);

// Delta, dq/dqp (query-outer), dk/dv/dkp partials per proxy head (key-outer), and the
// fixed-order reduction of the partials into the outputs.
template <class T, int kD, int kDp>
void launch_backward(const BackwardKernelParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm80
