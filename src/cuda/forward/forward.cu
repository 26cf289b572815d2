// Host entry of the main attention forward, sparse and warmup (SPEC sections 2, 3, 5):
// validation, the CUDA backend's own limits, workspace sizing and dispatch on dtype and
// (D, Dp) to the portable sm80 kernel.
#include <cstdint>
#include <string>

#include "cuda/common/dispatch.h"
#include "cuda/common/limits.h"
#include "cuda/forward/sm80/forward_sm80.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

void check_limits(const ForwardParams& params) {
  const Problem& pr = params.problem;
  check_attention_limits(pr, sm80::kMaxGroup);
  check_vector_view("qp", params.qp);
  check_vector_view("kp", params.kp);
  check_vector_view("q", params.q);
  check_vector_view("k", params.k);
  check_vector_view("v", params.v);
  check_vector_view("out", params.out);
}

int64_t kl_slots(const Problem& pr) { return pr.batch * pr.proxy_heads * pr.seqlen; }

size_t workspace_bytes(const Problem& pr) {
  // One fp32 KL term per (b, p, i), rounded up to keep the caller's 256-byte alignment.
  return (static_cast<size_t>(kl_slots(pr)) * sizeof(float) + 255) / 256 * 256;
}

void forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream, bool warmup) {
  validate(params, warmup);
  check_limits(params);
  const Problem& pr = params.problem;
  if (params.kl)
    check_workspace_bytes(workspace.bytes, workspace_bytes(pr), "forward_workspace_bytes");
  if (params.kl && workspace.data == nullptr)
    throw Error("flash_msa: workspace: expected a non-null pointer when kl is requested, got null");
  constexpr float kLog2e = 1.4426950408889634f;
  float* kl_partial = params.kl ? static_cast<float*>(workspace.data) : nullptr;
  const sm80::ForwardKernelParams kp{
      .q = params.q.data,
      .q_stride_b = params.q.stride_b,
      .q_stride_h = params.q.stride_h,
      .q_stride_s = params.q.stride_s,
      .k = params.k.data,
      .k_stride_b = params.k.stride_b,
      .k_stride_h = params.k.stride_h,
      .k_stride_s = params.k.stride_s,
      .v = params.v.data,
      .v_stride_b = params.v.stride_b,
      .v_stride_h = params.v.stride_h,
      .v_stride_s = params.v.stride_s,
      .qp = params.qp.data,
      .qp_stride_b = params.qp.stride_b,
      .qp_stride_h = params.qp.stride_h,
      .qp_stride_s = params.qp.stride_s,
      .kp = params.kp.data,
      .kp_stride_b = params.kp.stride_b,
      .kp_stride_h = params.kp.stride_h,
      .kp_stride_s = params.kp.stride_s,
      .out = params.out.data,
      .out_stride_b = params.out.stride_b,
      .out_stride_h = params.out.stride_h,
      .out_stride_s = params.out.stride_s,
      .lse = params.lse,
      .lse_proxy = params.lse_proxy,
      .kl_partial = kl_partial,
      .indices = warmup ? nullptr : params.indices,
      .cu_seqlens = pr.cu_seqlens,
      .num_docs = static_cast<int>(pr.num_docs),
      .batch = static_cast<int>(pr.batch),
      .seqlen = static_cast<int>(pr.seqlen),
      .heads = static_cast<int>(pr.heads),
      .proxy_heads = static_cast<int>(pr.proxy_heads),
      .group = static_cast<int>(pr.heads / pr.proxy_heads),
      .kv_group = static_cast<int>(pr.heads / pr.kv_heads),
      .proxy_group = static_cast<int>(pr.proxy_heads / pr.proxy_kv_heads),
      .top_k = static_cast<int>(pr.top_k),
      .num_blocks = static_cast<int>((pr.seqlen + kBlockSize - 1) / kBlockSize),
      .scale_log2 = pr.scale * kLog2e,
      .proxy_scale_log2 = pr.proxy_scale * kLog2e,
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    sm80::launch_forward<T, kD, kDp>(kp, stream);
  });
  if (params.kl) sm80::launch_kl_reduce(kl_partial, kl_slots(pr), params.kl, stream);
}

}  // namespace

size_t forward_workspace_bytes(const ForwardParams& params, bool warmup) {
  validate(params, warmup);
  return workspace_bytes(params.problem);
}

void sparse_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  forward(params, workspace, stream, false);
}

void warmup_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  forward(params, workspace, stream, true);
}

}  // namespace flash_msa::cuda
