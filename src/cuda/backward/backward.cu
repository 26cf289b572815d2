// Host entry of the MSA backward, sparse and warmup (SPEC sections 4, 5): validation, the CUDA
// backend's own limits, workspace sizing and dispatch on dtype and (D, Dp) to the portable sm80
// kernels (design: cuda/backward/sm80/backward_kernel.cuh). Deterministic in both modes: no
// floating-point atomics are used, so BackwardParams::deterministic needs no separate path.
#include <cstdint>
#include <string>

#include "cuda/backward/sm80/backward_sm80.h"
#include "cuda/common/dispatch.h"
#include "cuda/common/limits.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

void check_limits(const BackwardParams& params) {
  const Problem& pr = params.problem;
  check_attention_limits(pr, sm80::kMaxGroup);
  check_vector_view("qp", params.qp);
  check_vector_view("kp", params.kp);
  check_vector_view("q", params.q);
  check_vector_view("k", params.k);
  check_vector_view("v", params.v);
  check_vector_view("out", params.out);
  check_vector_view("dout", params.dout);
  check_vector_view("dqp", params.dqp);
  check_vector_view("dkp", params.dkp);
  check_vector_view("dq", params.dq);
  check_vector_view("dk", params.dk);
  check_vector_view("dv", params.dv);
}

sm80::BackwardWorkspace layout_of(const Problem& pr) {
  return sm80::backward_workspace_layout(pr.batch, pr.heads, pr.proxy_heads, pr.seqlen, pr.head_dim,
                                         pr.proxy_head_dim);
}

void backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream, bool warmup) {
  validate(params, warmup);
  check_limits(params);
  const Problem& pr = params.problem;
  const sm80::BackwardWorkspace ws = layout_of(pr);
  check_workspace_bytes(workspace.bytes, ws.total, "backward_workspace_bytes");
  if (workspace.data == nullptr || reinterpret_cast<uintptr_t>(workspace.data) % 256 != 0)
    throw Error("flash_msa: workspace: expected a non-null 256-byte aligned pointer, got " +
                std::to_string(reinterpret_cast<uintptr_t>(workspace.data)));
  auto* base = static_cast<unsigned char*>(workspace.data);
  const sm80::BackwardKernelParams kp{
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
      .dout = params.dout.data,
      .dout_stride_b = params.dout.stride_b,
      .dout_stride_h = params.dout.stride_h,
      .dout_stride_s = params.dout.stride_s,
      .dq = params.dq.data,
      .dq_stride_b = params.dq.stride_b,
      .dq_stride_h = params.dq.stride_h,
      .dq_stride_s = params.dq.stride_s,
      .dqp = params.dqp.data,
      .dqp_stride_b = params.dqp.stride_b,
      .dqp_stride_h = params.dqp.stride_h,
      .dqp_stride_s = params.dqp.stride_s,
      .dk = params.dk.data,
      .dk_stride_b = params.dk.stride_b,
      .dk_stride_h = params.dk.stride_h,
      .dk_stride_s = params.dk.stride_s,
      .dv = params.dv.data,
      .dv_stride_b = params.dv.stride_b,
      .dv_stride_h = params.dv.stride_h,
      .dv_stride_s = params.dv.stride_s,
      .dkp = params.dkp.data,
      .dkp_stride_b = params.dkp.stride_b,
      .dkp_stride_h = params.dkp.stride_h,
      .dkp_stride_s = params.dkp.stride_s,
      .lse = params.lse,
      .lse_proxy = params.lse_proxy,
      .kl_grad = params.kl_grad,
      .indices = warmup ? nullptr : params.indices,
      .cu_seqlens = pr.cu_seqlens,
      .delta = reinterpret_cast<float*>(base + ws.delta),
      .dk_part = reinterpret_cast<float*>(base + ws.dk_part),
      .dv_part = reinterpret_cast<float*>(base + ws.dv_part),
      .dkp_part = reinterpret_cast<float*>(base + ws.dkp_part),
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
      .scale = pr.scale,
      .proxy_scale = pr.proxy_scale,
      .inv_rows = static_cast<float>(1.0 / (double(pr.batch) * pr.proxy_heads * pr.seqlen)),
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    sm80::launch_backward<T, kD, kDp>(kp, stream);
  });
}

}  // namespace

namespace sm80 {

BackwardWorkspace backward_workspace_layout(int64_t batch, int64_t heads, int64_t proxy_heads,
                                            int64_t seqlen, int64_t head_dim,
                                            int64_t proxy_head_dim) {
  auto aligned = [](int64_t floats) {
    return (static_cast<size_t>(floats) * sizeof(float) + 255) / 256 * 256;
  };
  BackwardWorkspace ws{};
  ws.delta = 0;
  ws.dk_part = ws.delta + aligned(batch * heads * seqlen);
  ws.dv_part = ws.dk_part + aligned(batch * proxy_heads * seqlen * head_dim);
  ws.dkp_part = ws.dv_part + aligned(batch * proxy_heads * seqlen * head_dim);
  ws.total = ws.dkp_part + aligned(batch * proxy_heads * seqlen * proxy_head_dim);
  return ws;
}

}  // namespace sm80

size_t backward_workspace_bytes(const BackwardParams& params, bool warmup) {
  validate(params, warmup);
  return layout_of(params.problem).total;
}

void sparse_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  backward(params, workspace, stream, false);
}

void warmup_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  backward(params, workspace, stream, true);
}

}  // namespace flash_msa::cuda
