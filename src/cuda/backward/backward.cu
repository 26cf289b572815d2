// Host entry of the sparse MSA backward (SPEC sections 4, 5): validation, the CUDA backend's
// limits, the plan (host/plan.h) and the launch sequence. Warmup lives in warmup/warmup.cu.
//
// Per call: the schedule's reverse index and Delta; then per token chunk its work items, the
// main kernel (dQ per edge, dK / dV per item, the teacher rows when the proxy gradients are
// wanted; backward/portable, or backward/sm90 where sparse_kernels() says kHopper), the proxy
// kernel (dQp per edge, dKp per item), and the fixed-order reductions of passes/: dq, dqp per
// token; dk, dv, dkp added into fp32 accumulators per chunk; finally the scaled stores. No
// floating-point atomics anywhere, so the gradients are bitwise reproducible.
#include <algorithm>
#include <cstdint>

#include "cuda/backward/portable/sparse_portable.h"
#include "cuda/backward/sm90/sparse_sm90.h"
#include "cuda/host/check.h"
#include "cuda/host/dispatch.h"
#include "cuda/host/impl.h"
#include "cuda/host/limits.h"
#include "cuda/host/plan.h"
#include "cuda/host/variants.h"
#include "cuda/passes/passes.h"
#include "cuda/proxy/portable/proxy_portable.h"
#include "cuda/warmup/warmup.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

// The sparse backward's arrays for chunks of `chunk` tokens per batch row.
struct Buffers {
  void* index;
  void* items;
  float* delta;     // [B, H, Sq]
  float* dk_acc;    // [B, Hk, S, D]
  float* dv_acc;    // [B, Hk, S, D]
  float* dkp_acc;   // [B, Hpk, S, Dp]
  void* dq_part;    // [chunk edges, G, D] dtype
  float* dqp_part;  // [chunk edges, Dp]
  float* teacher;   // [chunk edges, 128]
  float* dk_part;   // [items, 128, D]
  float* dv_part;   // [items, 128, D]
  float* dkp_part;  // [items, 128, Dp]
  float* kl_part;   // [chunk edges] (KL value only)
  float* kl_rows;   // [B, Hp, Sq] (KL value only)
};

// The layout function of SparsePlan; `out` (may be null) receives the arrays.
auto layout(const Problem& pr, bool kl, Buffers* out = nullptr) {
  return [&pr, kl, out](int64_t chunk, Carver& c) {
    const schedule::Shape shape{pr.batch, pr.seqlen,      pr.proxy_heads,
                                pr.top_k, pr.query_offset, pr.queries()};
    const int64_t edges = pr.batch * pr.proxy_heads * chunk * pr.top_k;
    const int64_t items = chunk > 0 ? schedule::max_items(shape, chunk) : 0;
    const int64_t D = pr.head_dim, Dp = pr.proxy_head_dim, S = pr.seqlen;
    Buffers b{};
    b.index = c.take_bytes(schedule::index_workspace_bytes(shape));
    b.items = c.take_bytes(schedule::items_workspace_bytes(shape));
    b.delta = c.take<float>(pr.batch * pr.heads * pr.queries());
    b.dk_acc = c.take<float>(pr.batch * pr.kv_heads * S * D);
    b.dv_acc = c.take<float>(pr.batch * pr.kv_heads * S * D);
    b.dkp_acc = c.take<float>(pr.batch * pr.proxy_kv_heads * S * Dp);
    b.dq_part = c.take<uint16_t>(edges * (pr.heads / pr.proxy_heads) * D);
    b.dqp_part = c.take<float>(edges * Dp);
    b.teacher = c.take<float>(edges * kBlockSize);
    b.dk_part = c.take<float>(items * kBlockSize * D);
    b.dv_part = c.take<float>(items * kBlockSize * D);
    b.dkp_part = c.take<float>(items * kBlockSize * Dp);
    b.kl_part = c.take<float>(kl ? edges : 0);
    b.kl_rows = c.take<float>(kl ? pr.batch * pr.proxy_heads * pr.queries() : 0);
    if (out) *out = b;
  };
}

}  // namespace

size_t backward_workspace_bytes(const BackwardParams& params, bool warmup,
                                int64_t max_chunk_tokens) {
  validate(params, warmup);
  if (warmup) return warmup::backward_workspace_bytes(params);
  return SparsePlan::workspace_bytes(params.problem, max_chunk_tokens,
                                     layout(params.problem, params.kl != nullptr));
}

void sparse_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, false);
  const Problem& pr = params.problem;
  check_sparse_limits(pr);
  check_views(params);
  const bool kl = params.kl != nullptr;
  const SparsePlan plan =
      SparsePlan::for_workspace(pr, workspace.bytes, layout(pr, kl), "backward_workspace_bytes");
  Buffers ws{};
  plan.carve(workspace.data, layout(pr, kl, &ws));
  const KernelShape& shape = plan.shape();
  const bool hopper = sparse_backward_variant(pr, current_chip()).kernels == Kernels::kHopper;
  const schedule::Index index = schedule::build_index(plan.schedule_shape(), params.indices,
                                                      pr.cu_seqlens, pr.num_docs, ws.index, stream);
  const bool proxy = params.kl_grad != nullptr;  // w = 0 otherwise: zero proxy gradients
  // The proxy pass runs for the gradients or the KL value (then with w = 0, its parts unused).
  const bool teacher = proxy || kl;
  const int D = shape.head_dim, Dp = shape.proxy_head_dim;

  const auto zero = [&](float* acc, int64_t floats) {
    FLASH_MSA_CUDA_CHECK(
        cudaMemsetAsync(acc, 0, static_cast<size_t>(floats) * sizeof(float), stream));
  };
  zero(ws.dk_acc, pr.batch * pr.kv_heads * pr.seqlen * D);
  zero(ws.dv_acc, pr.batch * pr.kv_heads * pr.seqlen * D);
  if (proxy) zero(ws.dkp_acc, pr.batch * pr.proxy_kv_heads * pr.seqlen * Dp);
  const passes::DeltaParams delta{
      .out = params.out,
      .dout = params.dout,
      .delta = ws.delta,
      .shape = shape,
  };

  plan.for_each_chunk(
      index, ws.items, stream, [&](const Chunk& chunk, const schedule::Items& items) {
        const portable::SparseBackwardParams bp{
            .q = params.q,
            .k = params.k,
            .v = params.v,
            .dout = params.dout,
            .index = index,
            .items = items,
            .lse = stats32(params.lse),
            .delta = ws.delta,
            .dq_part = ws.dq_part,
            .teacher = teacher ? ws.teacher : nullptr,
            .dk_part = ws.dk_part,
            .dv_part = ws.dv_part,
            .shape = shape,
            .chunk = chunk,
        };
        const portable::ProxyParams pp{
            .qp = params.qp,
            .kp = params.kp,
            .index = index,
            .items = items,
            .lse_proxy = stats32(params.lse_proxy),
            .teacher = ws.teacher,
            .kl_grad = stats32(params.kl_grad),
            .kl_part = kl ? ws.kl_part : nullptr,
            .dqp_part = ws.dqp_part,
            .dkp_part = ws.dkp_part,
            .shape = shape,
            .chunk = chunk,
        };
        const passes::MergeParams kl_rows{
            .kl_part = ws.kl_part,
            .kl_rows = ws.kl_rows,
            .indices = params.indices,
            .doc_start = index.doc_start,
            .shape = shape,
            .chunk = chunk,
        };
        const auto rows = [&](const void* part, const MutView& dst, float scale, int rows,
                              int width) {
          return passes::RowsReduceParams{
              .part = part,
              .dst = dst,
              .indices = params.indices,
              .doc_start = index.doc_start,
              .scale = scale,
              .rows = rows,
              .width = width,
              .shape = shape,
              .chunk = chunk,
          };
        };
        const auto keys = [&](const float* part, float* acc, int width, int64_t out_heads) {
          return passes::KeysReduceParams{
              .part = part,
              .acc = acc,
              .items = items,
              .width = width,
              .out_heads = static_cast<int>(out_heads),
              .heads_per_out = static_cast<int>(pr.proxy_heads / out_heads),
              .keys = static_cast<int>(std::min<int64_t>(
                  pr.seqlen, (chunk.end + kBlockSize - 1) / kBlockSize * kBlockSize)),
              .shape = shape,
          };
        };
        dispatch_attention(
            pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
              if (chunk.begin == shape.query_offset) passes::launch_delta<T>(delta, stream);
              if (hopper)
                sm90::launch_sparse_backward<T>(bp, stream);
              else
                portable::launch_sparse_backward<T, kD, false>(bp, stream);
              if (teacher) portable::launch_proxy<T, kDp, portable::ProxyMode::kGrad>(pp, stream);
              if (kl) passes::launch_kl_rows(kl_rows, stream);
              passes::launch_rows_reduce<T, T>(
                  rows(ws.dq_part, params.dq, pr.scale, shape.group, D), stream);
              passes::launch_rows_reduce<T, float>(
                  rows(proxy ? ws.dqp_part : nullptr, params.dqp, pr.proxy_scale, 1, Dp), stream);
            });
        passes::launch_keys_reduce(keys(ws.dk_part, ws.dk_acc, D, pr.kv_heads), stream);
        passes::launch_keys_reduce(keys(ws.dv_part, ws.dv_acc, D, pr.kv_heads), stream);
        if (proxy)
          passes::launch_keys_reduce(keys(ws.dkp_part, ws.dkp_acc, Dp, pr.proxy_kv_heads), stream);
      });
  if (kl)
    passes::launch_kl_reduce(ws.kl_rows, plan.shape(), stats32(params.kl), stream);
  const auto store = [&](const float* acc, const MutView& dst, float scale, int64_t heads,
                         int width) {
    return passes::KeysStoreParams{
        .acc = acc,
        .dst = dst,
        .scale = scale,
        .out_heads = static_cast<int>(heads),
        .width = width,
        .tokens = shape.seqlen,
        .permuted = false,
        .shape = shape,
    };
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    passes::launch_keys_store<T>(store(ws.dk_acc, params.dk, pr.scale, pr.kv_heads, D), stream);
    passes::launch_keys_store<T>(store(ws.dv_acc, params.dv, 1.f, pr.kv_heads, D), stream);
    passes::launch_keys_store<T>(
        store(proxy ? ws.dkp_acc : nullptr, params.dkp, pr.proxy_scale, pr.proxy_kv_heads, Dp),
        stream);
  });
}

}  // namespace flash_msa::cuda
