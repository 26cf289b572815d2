// Host entry of warmup mode (SPEC section 5): both branches over every visible key. Validation, the
// CUDA backend's limits, the workspace and the launches of the kernels warmup_kernels() picks: the
// Hopper dense kernels (forward/sm90/dense_sm90.h and warmup/sm90; D = Dp = 128, G <= 64) or the
// portable query-outer ones (warmup/portable; G <= 16). A forward asked for the KL value also runs
// the portable forward, whose second walk computes it (into scratch outputs where the Hopper
// forward writes the results); the default is the backward's value, which the Hopper backward
// computes from the teacher it has at hand.
#include <cstdint>

#include "cuda/forward/sm90/dense_sm90.h"
#include "cuda/host/dispatch.h"
#include "cuda/host/impl.h"
#include "cuda/host/limits.h"
#include "cuda/host/plan.h"
#include "cuda/host/variants.h"
#include "cuda/passes/passes.h"
#include "cuda/warmup/portable/warmup_portable.h"
#include "cuda/warmup/sm90/warmup_sm90.h"
#include "cuda/warmup/warmup.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

bool hopper_warmup(const Problem& pr) {
  return warmup_variant(pr, current_chip()).kernels == Kernels::kHopper;
}

// The forward's arrays: the portable forward's one fp32 KL term per (b, p, i) (KL value only);
// where the Hopper kernels run, the document starts and, for the KL value, scratch outputs of
// the portable forward (whose second walk computes the value; the outputs come from the Hopper
// forward, so that asking for the value changes no other result).
struct ForwardBuffers {
  float* kl_partial;   // [B, Hp, Sq]
  int32_t* doc_start;  // [B * S]
  void* out;           // [B, H, Sq, D] dtype
  float* lse;          // [B, H, Sq]
  float* lse_proxy;    // [B, Hp, Sq]
};

auto forward_layout(const Problem& pr, bool hopper, bool kl, ForwardBuffers* out = nullptr) {
  return [&pr, hopper, kl, out](Carver& c) {
    const int64_t rows = pr.batch * pr.heads * pr.queries();
    const bool scratch = hopper && kl;
    ForwardBuffers b{};
    b.kl_partial = c.take<float>(kl ? pr.batch * pr.proxy_heads * pr.queries() : 0);
    b.doc_start = c.take<int32_t>(hopper && pr.cu_seqlens ? pr.batch * pr.seqlen : 0);
    b.out = c.take<uint16_t>(scratch ? rows * pr.head_dim : 0);
    b.lse = c.take<float>(scratch ? rows : 0);
    b.lse_proxy = c.take<float>(scratch ? pr.batch * pr.proxy_heads * pr.queries() : 0);
    if (out) *out = b;
  };
}

// The portable backward's fp32 arrays: Delta, and dk / dv / dkp per proxy head before their
// reduction.
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

// The Hopper backward's arrays; dq_acc .. order are zeroed by one memset (zero_end: their end).
struct DenseBuffers {
  float* delta;        // [B, H, Sq]
  int32_t* doc_start;  // [B * S] (documents only)
  float* dk_part;      // [B, Hp, S, D]
  float* dv_part;      // [B, Hp, S, D]
  float* kl_part;      // [B * Hp * NB]
  float* dq_acc;       // [B, H, Sq, D]
  float* dqp_acc;      // [B, Hp, Sq, Dp]
  float* dkp_part;     // [B, Hp, S, Dp]
  int32_t* order;      // [B * Hp * ceil(Sq / 64) * (G + 1) + 1]
  unsigned char* zero_end;
};

auto dense_backward_layout(const Problem& pr, DenseBuffers* out = nullptr) {
  return [&pr, out](Carver& c) {
    const int64_t rows = pr.batch * pr.proxy_heads * pr.seqlen;
    const int64_t blocks = (pr.seqlen + kBlockSize - 1) / kBlockSize;
    const int64_t chunks = (pr.queries() + sm90::kDenseChunkRows - 1) / sm90::kDenseChunkRows;
    DenseBuffers b{};
    b.delta = c.take<float>(pr.batch * pr.heads * pr.queries());
    b.doc_start = c.take<int32_t>(pr.cu_seqlens ? pr.batch * pr.seqlen : 0);
    b.dk_part = c.take<float>(rows * pr.head_dim);
    b.dv_part = c.take<float>(rows * pr.head_dim);
    b.kl_part = c.take<float>(pr.batch * pr.proxy_heads * blocks);
    b.dq_acc = c.take<float>(pr.batch * pr.heads * pr.queries() * pr.head_dim);
    b.dqp_acc = c.take<float>(pr.batch * pr.proxy_heads * pr.queries() * pr.proxy_head_dim);
    b.dkp_part = c.take<float>(rows * pr.proxy_head_dim);
    const int64_t slots = pr.heads / pr.proxy_heads + 1;
    b.order = c.take<int32_t>(pr.batch * pr.proxy_heads * chunks * slots + 1);
    b.zero_end = c.take<unsigned char>(0);
    if (out) *out = b;
  };
}

portable::BackwardKernelParams portable_backward_params(const BackwardParams& params,
                                                        const BackwardBuffers& ws) {
  return {
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
      .cu_seqlens = params.problem.cu_seqlens,
      .delta = ws.delta,
      .dk_part = ws.dk_part,
      .dv_part = ws.dv_part,
      .dkp_part = ws.dkp_part,
      .kl_rows = params.kl ? ws.kl_rows : nullptr,
      .shape = kernel_shape(params.problem),
  };
}

// The Hopper kernels' document starts: launched into `buffer` with documents, null without.
const int32_t* doc_starts(const Problem& pr, int32_t* buffer, cudaStream_t stream) {
  if (!pr.cu_seqlens) return nullptr;
  schedule::launch_doc_start(pr.cu_seqlens, pr.num_docs, pr.batch, pr.seqlen, buffer, stream);
  return buffer;
}

// The limits of the kernels warmup_kernels() picks: G <= 16 for the portable ones.
void check_warmup_limits(const Problem& pr, bool hopper) {
  check_attention_limits(pr, hopper ? 64 : portable::kMaxGroup);
}

void hopper_backward_launch(const BackwardParams& params, Workspace workspace,
                            cudaStream_t stream) {
  const Problem& pr = params.problem;
  DenseBuffers ws{};
  carve_workspace(workspace, dense_backward_layout(pr, &ws), "backward_workspace_bytes");
  const KernelShape shape = kernel_shape(pr);
  FLASH_MSA_CUDA_CHECK(cudaMemsetAsync(
      ws.dq_acc, 0, ws.zero_end - reinterpret_cast<unsigned char*>(ws.dq_acc), stream));
  const sm90::DenseBackwardParams bp{
      .q = params.q,
      .k = params.k,
      .v = params.v,
      .qp = params.qp,
      .kp = params.kp,
      .dout = params.dout,
      .lse = stats32(params.lse),
      .lse_proxy = stats32(params.lse_proxy),
      .delta = ws.delta,
      .kl_grad = stats32(params.kl_grad),
      .doc_start = doc_starts(pr, ws.doc_start, stream),
      .dq_acc = ws.dq_acc,
      .dqp_acc = ws.dqp_acc,
      .dk_part = ws.dk_part,
      .dv_part = ws.dv_part,
      .dkp_part = ws.dkp_part,
      .kl_part = ws.kl_part,
      .order = ws.order,
      .shape = shape,
  };
  const BackwardBuffers parts{.delta = ws.delta,
                              .dk_part = ws.dk_part,
                              .dv_part = ws.dv_part,
                              .dkp_part = ws.dkp_part,
                              .kl_rows = nullptr};
  const auto store = [&](const float* acc, const MutView& dst, float scale, int64_t heads,
                         int64_t width) {
    return passes::KeysStoreParams{
        .acc = acc,
        .dst = dst,
        .scale = scale,
        .out_heads = static_cast<int>(heads),
        .width = static_cast<int>(width),
        .tokens = shape.queries,
        .permuted = true,
        .shape = shape,
    };
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    passes::launch_delta<T>(
        {.out = params.out, .dout = params.dout, .delta = ws.delta, .shape = shape}, stream);
    sm90::launch_dense_backward<T>(bp, stream);
    passes::launch_keys_store<T>(store(ws.dq_acc, params.dq, pr.scale, pr.heads, kD), stream);
    passes::launch_keys_store<T>(store(ws.dqp_acc, params.dqp, pr.proxy_scale, pr.proxy_heads, kDp),
                                 stream);
    portable::launch_backward_reduce<T, kD, kDp>(portable_backward_params(params, parts), stream);
  });
  if (params.kl)
    passes::launch_kl_sum(ws.kl_part, pr.batch * pr.proxy_heads * shape.num_blocks, shape,
                          stats32(params.kl), stream);
}

}  // namespace

namespace warmup {

size_t forward_workspace_bytes(const ForwardParams& params) {
  return layout_bytes(
      forward_layout(params.problem, hopper_warmup(params.problem), params.kl != nullptr));
}

size_t backward_workspace_bytes(const BackwardParams& params) {
  if (hopper_warmup(params.problem)) return layout_bytes(dense_backward_layout(params.problem));
  return layout_bytes(backward_layout(params.problem, params.kl != nullptr));
}

}  // namespace warmup

void warmup_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, true);
  const Problem& pr = params.problem;
  const bool hopper = hopper_warmup(pr), kl = params.kl != nullptr;
  // The KL value needs the portable forward (G <= 16).
  check_warmup_limits(pr, hopper && !kl);
  check_views(params);
  ForwardBuffers ws{};
  if (kl || (hopper && pr.cu_seqlens))
    carve_workspace(workspace, forward_layout(pr, hopper, kl, &ws), "forward_workspace_bytes");
  const KernelShape shape = kernel_shape(pr);
  // The portable forward: the results, or on Hopper only the KL value.
  if (kl || !hopper) {
    portable::ForwardKernelParams kp{
        .q = params.q,
        .k = params.k,
        .v = params.v,
        .qp = params.qp,
        .kp = params.kp,
        .out = params.out,
        .lse = stats32(params.lse),
        .lse_proxy = stats32(params.lse_proxy),
        .kl_partial = kl ? ws.kl_partial : nullptr,
        .cu_seqlens = pr.cu_seqlens,
        .shape = shape,
    };
    if (hopper) {
      kp.out = contiguous_view<void>(ws.out, pr.heads, pr.queries(), pr.head_dim);
      kp.lse = ws.lse;
      kp.lse_proxy = ws.lse_proxy;
    }
    dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
      portable::launch_forward<T, kD, kDp>(kp, stream);
    });
    if (kl) passes::launch_kl_reduce(ws.kl_partial, shape, stats32(params.kl), stream);
    if (!hopper) return;
  }
  const sm90::DenseForwardParams fp{
      .q = params.q,
      .k = params.k,
      .v = params.v,
      .qp = params.qp,
      .kp = params.kp,
      .out = params.out,
      .lse = stats32(params.lse),
      .lse_proxy = stats32(params.lse_proxy),
      .doc_start = doc_starts(pr, ws.doc_start, stream),
      .shape = shape,
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    sm90::launch_dense_forward<T>(fp, stream);
  });
}

void warmup_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, true);
  const Problem& pr = params.problem;
  const bool hopper = hopper_warmup(pr);
  check_warmup_limits(pr, hopper);
  check_views(params);
  if (hopper) {
    hopper_backward_launch(params, workspace, stream);
    return;
  }
  BackwardBuffers ws{};
  carve_workspace(workspace, backward_layout(pr, params.kl != nullptr, &ws),
                  "backward_workspace_bytes");
  const portable::BackwardKernelParams kp = portable_backward_params(params, ws);
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    portable::launch_backward<T, kD, kDp>(kp, stream);
  });
  if (params.kl) passes::launch_kl_reduce(ws.kl_rows, kp.shape, stats32(params.kl), stream);
}

}  // namespace flash_msa::cuda
