// Host entry of warmup mode (SPEC section 5): both branches over every visible key, with the
// query-outer dense kernels of warmup/portable: validation, the CUDA backend's limits, the
// workspace and the launches.
#include <cstdint>

#include "cuda/host/dispatch.h"
#include "cuda/host/limits.h"
#include "cuda/host/plan.h"
#include "cuda/passes/passes.h"
#include "cuda/warmup/portable/warmup_portable.h"
#include "cuda/warmup/warmup.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

// The forward's one fp32 KL term per (b, p, i), with the KL value only.
auto forward_layout(const Problem& pr, bool kl, float** kl_partial = nullptr) {
  return [&pr, kl, kl_partial](Carver& c) {
    float* at = c.take<float>(kl ? pr.batch * pr.proxy_heads * pr.queries() : 0);
    if (kl_partial) *kl_partial = at;
  };
}

// The backward's fp32 arrays: Delta, and dk / dv / dkp per proxy head before their reduction.
struct BackwardBuffers {
  float* delta;     // [B, H, Sq]
  float* dk_part;   // [B, Hp, S, D]
  float* dv_part;   // [B, Hp, S, D]
  float* dkp_part;  // [B, Hp, S, Dp]
  float* kl_rows;   // [B, Hp, Sq] (KL value only)
};

auto backward_layout(const Problem& pr, bool kl, BackwardBuffers* out = nullptr) {
  return [&pr, kl, out](Carver& c) {
    const int64_t rows = pr.batch * pr.proxy_heads * pr.seqlen;
    BackwardBuffers b{};
    b.delta = c.take<float>(pr.batch * pr.heads * pr.queries());
    b.dk_part = c.take<float>(rows * pr.head_dim);
    b.dv_part = c.take<float>(rows * pr.head_dim);
    b.dkp_part = c.take<float>(rows * pr.proxy_head_dim);
    b.kl_rows = c.take<float>(kl ? pr.batch * pr.proxy_heads * pr.queries() : 0);
    if (out) *out = b;
  };
}

}  // namespace

namespace warmup {

size_t forward_workspace_bytes(const ForwardParams& params) {
  return layout_bytes(forward_layout(params.problem, params.kl != nullptr));
}

size_t backward_workspace_bytes(const BackwardParams& params) {
  return layout_bytes(backward_layout(params.problem, params.kl != nullptr));
}

}  // namespace warmup

void warmup_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, true);
  const Problem& pr = params.problem;
  check_attention_limits(pr, portable::kMaxGroup);
  check_views(params);
  float* kl_partial = nullptr;
  if (params.kl)
    carve_workspace(workspace, forward_layout(pr, true, &kl_partial), "forward_workspace_bytes");
  const portable::ForwardKernelParams kp{
      .q = params.q,
      .k = params.k,
      .v = params.v,
      .qp = params.qp,
      .kp = params.kp,
      .out = params.out,
      .lse = stats32(params.lse),
      .lse_proxy = stats32(params.lse_proxy),
      .kl_partial = kl_partial,
      .cu_seqlens = pr.cu_seqlens,
      .shape = kernel_shape(pr),
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    portable::launch_forward<T, kD, kDp>(kp, stream);
  });
  if (params.kl)
    passes::launch_kl_reduce(kl_partial, kp.shape, stats32(params.kl), stream);
}

void warmup_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, true);
  const Problem& pr = params.problem;
  check_attention_limits(pr, portable::kMaxGroup);
  check_views(params);
  BackwardBuffers ws{};
  carve_workspace(workspace, backward_layout(pr, params.kl != nullptr, &ws),
                  "backward_workspace_bytes");
  const portable::BackwardKernelParams kp{
      .q = params.q,
      .k = params.k,
      .v = params.v,
      .qp = params.qp,
      .kp = params.kp,
      .out = params.out,
      .dout = params.dout,
      .dq = params.dq,
      .dqp = params.dqp,
      .dk = params.dk,
      .dv = params.dv,
      .dkp = params.dkp,
      .lse = stats32(params.lse),
      .lse_proxy = stats32(params.lse_proxy),
      .kl_grad = stats32(params.kl_grad),
      .cu_seqlens = pr.cu_seqlens,
      .delta = ws.delta,
      .dk_part = ws.dk_part,
      .dv_part = ws.dv_part,
      .dkp_part = ws.dkp_part,
      .kl_rows = params.kl ? ws.kl_rows : nullptr,
      .shape = kernel_shape(pr),
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    portable::launch_backward<T, kD, kDp>(kp, stream);
  });
  if (params.kl)
    passes::launch_kl_reduce(ws.kl_rows, kp.shape, stats32(params.kl), stream);
}

}  // namespace flash_msa::cuda
