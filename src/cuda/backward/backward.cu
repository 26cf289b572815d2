// Host entry of the MSA backward, sparse and warmup (SPEC sections 4, 5): validation, the CUDA
// backend's own limits, workspace layout and the launch sequence. Deterministic in both modes:
// no floating-point atomics are used, so BackwardParams::deterministic needs no separate path.
//
// Sparse (key-block-outer, backward/sm80/sparse_kernel.cuh; on Hopper with D = 128 the main
// kernel is backward/sm90/sparse_kernel.cuh): the schedule's reverse index and Delta, then per
// token chunk its work items, the main kernel (dQ per edge, dK / dV per item,
// the teacher rows when the proxy gradients are wanted), the proxy kernel (dQp per edge, dKp per
// item), and fixed-order reductions: dq, dqp per token; dk, dv, dkp added into fp32
// accumulators per chunk; finally the scaled stores.
// Warmup (dense): the kernels of backward/sm80/backward_kernel.cuh.
#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/backward/sm80/backward_sm80.h"
#include "cuda/backward/sm80/sparse_sm80.h"
#include "cuda/backward/sm90/sparse_sm90.h"
#include "cuda/common/check.h"
#include "cuda/common/dispatch.h"
#include "cuda/common/limits.h"
#include "cuda/common/workspace.h"
#include "cuda/proxy/sm80/proxy_sm80.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
// Default workspace: what the smallest chunk needs (index, accumulators over S, and a partial
// item per bucket, which grow with S) plus this much for the per-token partial buffers.
constexpr size_t kDefaultChunkBytes = size_t(8) << 30;

void check_views(const BackwardParams& params) {
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

schedule::Shape schedule_shape(const Problem& pr) {
  return {pr.batch, pr.seqlen, pr.proxy_heads, pr.top_k};
}

// The sparse path's workspace for chunks of `chunk` tokens per batch row (null base: sizes).
struct SparseLayout {
  void* index;
  void* items;
  float* delta;     // [B, H, S]
  float* dk_acc;    // [B, Hk, S, D]
  float* dv_acc;    // [B, Hk, S, D]
  float* dkp_acc;   // [B, Hpk, S, Dp]
  void* dq_part;    // [edges, G, D] dtype
  float* dqp_part;  // [edges, Dp]
  float* teacher;   // [edges, 128]
  float* dk_part;   // [items, 128, D]
  float* dv_part;   // [items, 128, D]
  float* dkp_part;  // [items, 128, Dp]
  size_t total;
};

SparseLayout sparse_layout(const Problem& pr, int64_t chunk, void* base) {
  const schedule::Shape shape = schedule_shape(pr);
  const int64_t edges = pr.batch * pr.proxy_heads * chunk * pr.top_k;
  const int64_t items = chunk > 0 ? schedule::max_items(shape, chunk) : 0;
  const int64_t D = pr.head_dim, Dp = pr.proxy_head_dim, S = pr.seqlen;
  Carver c(base);
  SparseLayout l{};
  l.index = c.take_bytes(schedule::index_workspace_bytes(shape));
  l.items = c.take_bytes(schedule::items_workspace_bytes(shape));
  l.delta = c.take<float>(pr.batch * pr.heads * S);
  l.dk_acc = c.take<float>(pr.batch * pr.kv_heads * S * D);
  l.dv_acc = c.take<float>(pr.batch * pr.kv_heads * S * D);
  l.dkp_acc = c.take<float>(pr.batch * pr.proxy_kv_heads * S * Dp);
  l.dq_part = c.take<uint16_t>(edges * (pr.heads / pr.proxy_heads) * D);
  l.dqp_part = c.take<float>(edges * Dp);
  l.teacher = c.take<float>(edges * kBlockSize);
  l.dk_part = c.take<float>(items * kBlockSize * D);
  l.dv_part = c.take<float>(items * kBlockSize * D);
  l.dkp_part = c.take<float>(items * kBlockSize * Dp);
  l.total = c.used();
  return l;
}

// The largest chunk (all of S, or a multiple of 128) whose layout fits in `bytes`; 0 if none.
// The layout grows linearly with the chunk once it holds any token (a per-bucket term of the
// work items comes in at the first one), so the step between 128 and 256 tokens gives the slope.
int64_t chunk_for(const Problem& pr, size_t bytes) {
  const int64_t S = pr.seqlen;
  if (sparse_layout(pr, S, nullptr).total <= bytes) return S;
  const size_t first = sparse_layout(pr, kBlockSize, nullptr).total;
  const size_t per_block = sparse_layout(pr, 2 * kBlockSize, nullptr).total - first;
  if (bytes < first) return 0;
  int64_t chunk =
      std::min<int64_t>(static_cast<int64_t>(1 + (bytes - first) / per_block) * kBlockSize,
                        S / kBlockSize * kBlockSize);
  while (chunk > 0 && sparse_layout(pr, chunk, nullptr).total > bytes) chunk -= kBlockSize;
  return chunk;
}

size_t sparse_workspace_bytes(const Problem& pr, int64_t max_chunk) {
  const int64_t smallest = std::min<int64_t>(pr.seqlen, kBlockSize);
  const int64_t chunk =
      max_chunk > 0
          ? max_chunk / kBlockSize * kBlockSize
          : chunk_for(pr, sparse_layout(pr, smallest, nullptr).total + kDefaultChunkBytes);
  return sparse_layout(pr, std::min(std::max(chunk, smallest), pr.seqlen), nullptr).total;
}

void sparse_backward_impl(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, false);
  const Problem& pr = params.problem;
  check_sparse_limits(pr);
  check_views(params);
  const int64_t chunk = even_chunk(pr.seqlen, chunk_for(pr, workspace.bytes));
  const int64_t smallest = std::min<int64_t>(pr.seqlen, kBlockSize);
  if (chunk < smallest)
    check_workspace_bytes(workspace.bytes, sparse_layout(pr, smallest, nullptr).total,
                          "backward_workspace_bytes");
  check_workspace_pointer(workspace.data);
  const SparseLayout ws = sparse_layout(pr, chunk, workspace.data);
  const schedule::Shape shape = schedule_shape(pr);
  const schedule::Index index =
      schedule::build_index(shape, params.indices, pr.cu_seqlens, pr.num_docs, ws.index, stream);
  const bool proxy = params.kl_grad != nullptr;  // w = 0 otherwise: zero proxy gradients
  const int group = static_cast<int>(pr.heads / pr.proxy_heads);
  const int num_blocks = static_cast<int>(shape.num_blocks());
  const int buckets = static_cast<int>(shape.buckets());
  const int B = static_cast<int>(pr.batch), S = static_cast<int>(pr.seqlen);
  const int Hp = static_cast<int>(pr.proxy_heads);
  const int D = static_cast<int>(pr.head_dim), Dp = static_cast<int>(pr.proxy_head_dim);

  const sm80::DeltaParams dp{
      .out = params.out,
      .dout = params.dout,
      .delta = ws.delta,
      .batch = B,
      .heads = static_cast<int>(pr.heads),
      .seqlen = S,
      .head_dim = D,
  };
  const auto zero = [&](float* acc, int64_t floats) {
    FLASH_MSA_CUDA_CHECK(
        cudaMemsetAsync(acc, 0, static_cast<size_t>(floats) * sizeof(float), stream));
  };
  zero(ws.dk_acc, pr.batch * pr.kv_heads * pr.seqlen * D);
  zero(ws.dv_acc, pr.batch * pr.kv_heads * pr.seqlen * D);
  if (proxy) zero(ws.dkp_acc, pr.batch * pr.proxy_kv_heads * pr.seqlen * Dp);

  for (int64_t begin = 0; begin < pr.seqlen; begin += chunk) {
    const int64_t end = std::min(pr.seqlen, begin + chunk);
    const schedule::Items items = schedule::build_items(shape, index, begin, end, ws.items, stream);
    const sm80::SparseBackwardParams bp{
        .q = params.q,
        .k = params.k,
        .v = params.v,
        .dout = params.dout,
        .index = index,
        .items = items,
        .lse = params.lse,
        .delta = ws.delta,
        .dq_part = ws.dq_part,
        .teacher = proxy ? ws.teacher : nullptr,
        .dk_part = ws.dk_part,
        .dv_part = ws.dv_part,
        .chunk_begin = static_cast<int>(begin),
        .chunk_tokens = static_cast<int>(chunk),
        .seqlen = S,
        .heads = static_cast<int>(pr.heads),
        .proxy_heads = Hp,
        .group = group,
        .kv_group = static_cast<int>(pr.heads / pr.kv_heads),
        .top_k = static_cast<int>(pr.top_k),
        .num_blocks = num_blocks,
        .buckets = buckets,
        .scale_log2 = pr.scale * kLog2e,
    };
    const sm80::ProxyParams pp{
        .qp = params.qp,
        .kp = params.kp,
        .index = index,
        .items = items,
        .lse_proxy = params.lse_proxy,
        .teacher = ws.teacher,
        .kl_grad = params.kl_grad,
        .dqp_part = ws.dqp_part,
        .dkp_part = ws.dkp_part,
        .chunk_begin = static_cast<int>(begin),
        .chunk_tokens = static_cast<int>(chunk),
        .seqlen = S,
        .proxy_heads = Hp,
        .proxy_group = static_cast<int>(pr.proxy_heads / pr.proxy_kv_heads),
        .top_k = static_cast<int>(pr.top_k),
        .num_blocks = num_blocks,
        .buckets = buckets,
        .proxy_scale_log2 = pr.proxy_scale * kLog2e,
        .inv_rows = static_cast<float>(1.0 / (double(pr.batch) * pr.proxy_heads * pr.seqlen)),
    };
    const auto rows = [&](const void* part, const MutView& dst, float scale, int rows, int width) {
      return sm80::RowsReduceParams{
          .part = part,
          .dst = dst,
          .indices = params.indices,
          .doc_start = index.doc_start,
          .scale = scale,
          .rows = rows,
          .width = width,
          .chunk_begin = static_cast<int>(begin),
          .chunk_tokens = static_cast<int>(chunk),
          .chunk_end = static_cast<int>(end),
          .batch = B,
          .seqlen = S,
          .proxy_heads = Hp,
          .top_k = static_cast<int>(pr.top_k),
      };
    };
    const auto keys = [&](const float* part, float* acc, int width, int64_t out_heads) {
      return sm80::KeysReduceParams{
          .part = part,
          .acc = acc,
          .items = items,
          .width = width,
          .out_heads = static_cast<int>(out_heads),
          .heads_per_out = static_cast<int>(pr.proxy_heads / out_heads),
          .keys = static_cast<int>(
              std::min(pr.seqlen, (end + kBlockSize - 1) / kBlockSize * kBlockSize)),
          .batch = B,
          .seqlen = S,
          .proxy_heads = Hp,
          .num_blocks = num_blocks,
      };
    };
    dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
      if (begin == 0) sm80::launch_delta<T>(dp, stream);
      if (kD != 128 || !sm90::launch_sparse_backward<T>(bp, stream))
        sm80::launch_sparse_backward<T, kD, false>(bp, stream);
      if (proxy) sm80::launch_proxy<T, kDp, sm80::ProxyMode::kGrad>(pp, stream);
      sm80::launch_rows_reduce<T, T>(rows(ws.dq_part, params.dq, pr.scale, group, D), stream);
      sm80::launch_rows_reduce<T, float>(
          rows(proxy ? ws.dqp_part : nullptr, params.dqp, pr.proxy_scale, 1, Dp), stream);
    });
    sm80::launch_keys_reduce(keys(ws.dk_part, ws.dk_acc, D, pr.kv_heads), stream);
    sm80::launch_keys_reduce(keys(ws.dv_part, ws.dv_acc, D, pr.kv_heads), stream);
    if (proxy)
      sm80::launch_keys_reduce(keys(ws.dkp_part, ws.dkp_acc, Dp, pr.proxy_kv_heads), stream);
  }
  const auto store = [&](const float* acc, const MutView& dst, float scale, int64_t heads,
                         int width) {
    return sm80::KeysStoreParams{
        .acc = acc,
        .dst = dst,
        .scale = scale,
        .batch = B,
        .heads = static_cast<int>(heads),
        .seqlen = S,
        .width = width,
    };
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    sm80::launch_keys_store<T>(store(ws.dk_acc, params.dk, pr.scale, pr.kv_heads, D), stream);
    sm80::launch_keys_store<T>(store(ws.dv_acc, params.dv, 1.f, pr.kv_heads, D), stream);
    sm80::launch_keys_store<T>(
        store(proxy ? ws.dkp_acc : nullptr, params.dkp, pr.proxy_scale, pr.proxy_kv_heads, Dp),
        stream);
  });
}

sm80::BackwardWorkspace layout_of(const Problem& pr) {
  return sm80::backward_workspace_layout(pr.batch, pr.heads, pr.proxy_heads, pr.seqlen, pr.head_dim,
                                         pr.proxy_head_dim);
}

void warmup_backward_impl(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, true);
  const Problem& pr = params.problem;
  check_attention_limits(pr, sm80::kMaxGroup);
  check_views(params);
  const sm80::BackwardWorkspace ws = layout_of(pr);
  check_workspace_bytes(workspace.bytes, ws.total, "backward_workspace_bytes");
  check_workspace_pointer(workspace.data);
  auto* base = static_cast<unsigned char*>(workspace.data);
  const sm80::BackwardKernelParams kp{
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
      .lse = params.lse,
      .lse_proxy = params.lse_proxy,
      .kl_grad = params.kl_grad,
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

size_t backward_workspace_bytes(const BackwardParams& params, bool warmup,
                                int64_t max_chunk_tokens) {
  validate(params, warmup);
  return warmup ? layout_of(params.problem).total
                : sparse_workspace_bytes(params.problem, max_chunk_tokens);
}

void sparse_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  sparse_backward_impl(params, workspace, stream);
}

void warmup_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream) {
  warmup_backward_impl(params, workspace, stream);
}

}  // namespace flash_msa::cuda
