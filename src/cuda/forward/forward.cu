// Host entry of the main attention forward, sparse and warmup (SPEC sections 2, 3, 5):
// validation, the CUDA backend's own limits, workspace layout and the launch sequence.
//
// Sparse (key-block-outer, forward/sm80/sparse_kernel.cuh; on Hopper with D = 128 the main
// kernel is forward/sm90/sparse_kernel.cuh): the schedule's reverse index, then per token chunk
// its work items, the main kernel (per-block partial out and lse), the proxy
// kernel (per-block lse_proxy partials; the Hopper main kernel computes them along when
// Dp = 128), the merge; with the KL value also the teacher rows
// (the main backward kernel in teacher mode) and the proxy kernel's KL terms, summed per row
// and reduced in a fixed order. Chunks bound the partial buffers: the whole sequence is one
// chunk when the workspace allows it.
// Warmup (dense): the query-outer kernel of forward/sm80/forward_kernel.cuh.
#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/backward/sm80/sparse_sm80.h"
#include "cuda/common/dispatch.h"
#include "cuda/common/limits.h"
#include "cuda/common/workspace.h"
#include "cuda/forward/sm80/forward_sm80.h"
#include "cuda/forward/sm80/sparse_sm80.h"
#include "cuda/forward/sm90/sparse_sm90.h"
#include "cuda/proxy/sm80/proxy_sm80.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
// Default workspace: what the smallest chunk needs (index and work items, which grow with S)
// plus this much for the per-token partial buffers.
constexpr size_t kDefaultChunkBytes = size_t(8) << 30;

void check_views(const ForwardParams& params) {
  check_vector_view("qp", params.qp);
  check_vector_view("kp", params.kp);
  check_vector_view("q", params.q);
  check_vector_view("k", params.k);
  check_vector_view("v", params.v);
  check_vector_view("out", params.out);
}

schedule::Shape schedule_shape(const Problem& pr) {
  return {pr.batch, pr.seqlen, pr.proxy_heads, pr.top_k};
}

// The sparse path's workspace for chunks of `chunk` tokens per batch row (null base: sizes).
struct SparseLayout {
  void* index;
  void* items;
  float* kl_rows;     // [B, Hp, S] (KL only)
  void* o_part;       // [edges, G, D] dtype
  float* lse_part;    // [edges, G]
  float* lse_p_part;  // [edges]
  float* teacher;     // [edges, 128] (KL only)
  float* kl_part;     // [edges] (KL only)
  size_t total;
};

SparseLayout sparse_layout(const Problem& pr, bool kl, int64_t chunk, void* base) {
  const schedule::Shape shape = schedule_shape(pr);
  const int64_t edges = pr.batch * pr.proxy_heads * chunk * pr.top_k;
  const int64_t group = pr.heads / pr.proxy_heads;
  Carver c(base);
  SparseLayout l{};
  l.index = c.take_bytes(schedule::index_workspace_bytes(shape));
  l.items = c.take_bytes(schedule::items_workspace_bytes(shape));
  l.kl_rows = c.take<float>(kl ? pr.batch * pr.proxy_heads * pr.seqlen : 0);
  l.o_part = c.take<uint16_t>(edges * group * pr.head_dim);
  l.lse_part = c.take<float>(edges * group);
  l.lse_p_part = c.take<float>(edges);
  l.teacher = c.take<float>(kl ? edges * kBlockSize : 0);
  l.kl_part = c.take<float>(kl ? edges : 0);
  l.total = c.used();
  return l;
}

// The largest chunk (all of S, or a multiple of 128) whose layout fits in `bytes`; 0 if none.
// The layout grows linearly with the chunk once it holds any token (a per-bucket term of the
// work items comes in at the first one), so the step between 128 and 256 tokens gives the slope.
int64_t chunk_for(const Problem& pr, bool kl, size_t bytes) {
  const int64_t S = pr.seqlen;
  if (sparse_layout(pr, kl, S, nullptr).total <= bytes) return S;
  const size_t first = sparse_layout(pr, kl, kBlockSize, nullptr).total;
  const size_t per_block = sparse_layout(pr, kl, 2 * kBlockSize, nullptr).total - first;
  if (bytes < first) return 0;
  int64_t chunk =
      std::min<int64_t>(static_cast<int64_t>(1 + (bytes - first) / per_block) * kBlockSize,
                        S / kBlockSize * kBlockSize);
  while (chunk > 0 && sparse_layout(pr, kl, chunk, nullptr).total > bytes) chunk -= kBlockSize;
  return chunk;
}

size_t sparse_workspace_bytes(const Problem& pr, bool kl, int64_t max_chunk) {
  const int64_t smallest = std::min<int64_t>(pr.seqlen, kBlockSize);
  const int64_t chunk =
      max_chunk > 0
          ? max_chunk / kBlockSize * kBlockSize
          : chunk_for(pr, kl, sparse_layout(pr, kl, smallest, nullptr).total + kDefaultChunkBytes);
  return sparse_layout(pr, kl, std::min(std::max(chunk, smallest), pr.seqlen), nullptr).total;
}

void sparse_forward_impl(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, false);
  const Problem& pr = params.problem;
  check_sparse_limits(pr);
  check_views(params);
  const bool kl = params.kl != nullptr;
  const int64_t chunk = even_chunk(pr.seqlen, chunk_for(pr, kl, workspace.bytes));
  const int64_t smallest = std::min<int64_t>(pr.seqlen, kBlockSize);
  if (chunk < smallest)
    check_workspace_bytes(workspace.bytes, sparse_layout(pr, kl, smallest, nullptr).total,
                          "forward_workspace_bytes");
  check_workspace_pointer(workspace.data);
  const SparseLayout ws = sparse_layout(pr, kl, chunk, workspace.data);
  const schedule::Shape shape = schedule_shape(pr);
  const schedule::Index index =
      schedule::build_index(shape, params.indices, pr.cu_seqlens, pr.num_docs, ws.index, stream);
  const int group = static_cast<int>(pr.heads / pr.proxy_heads);
  const int num_blocks = static_cast<int>(shape.num_blocks());
  const int buckets = static_cast<int>(shape.buckets());
  for (int64_t begin = 0; begin < pr.seqlen; begin += chunk) {
    const int64_t end = std::min(pr.seqlen, begin + chunk);
    const schedule::Items items = schedule::build_items(shape, index, begin, end, ws.items, stream);
    sm80::SparseForwardParams fp{
        .q = params.q,
        .k = params.k,
        .v = params.v,
        .index = index,
        .items = items,
        .o_part = ws.o_part,
        .lse_part = ws.lse_part,
        .chunk_begin = static_cast<int>(begin),
        .chunk_tokens = static_cast<int>(chunk),
        .seqlen = static_cast<int>(pr.seqlen),
        .proxy_heads = static_cast<int>(pr.proxy_heads),
        .group = group,
        .kv_group = static_cast<int>(pr.heads / pr.kv_heads),
        .top_k = static_cast<int>(pr.top_k),
        .num_blocks = num_blocks,
        .buckets = buckets,
        .scale_log2 = pr.scale * kLog2e,
        .qp = params.qp,
        .kp = params.kp,
        .lse_p_part = nullptr,
        .proxy_group = static_cast<int>(pr.proxy_heads / pr.proxy_kv_heads),
        .proxy_scale_log2 = pr.proxy_scale * kLog2e,
    };
    sm80::ProxyParams pp{
        .qp = params.qp,
        .kp = params.kp,
        .index = index,
        .items = items,
        .lse_proxy = params.lse_proxy,
        .teacher = ws.teacher,
        .kl_grad = nullptr,
        .lse_p_part = ws.lse_p_part,
        .kl_part = ws.kl_part,
        .dqp_part = nullptr,
        .dkp_part = nullptr,
        .chunk_begin = static_cast<int>(begin),
        .chunk_tokens = static_cast<int>(chunk),
        .seqlen = static_cast<int>(pr.seqlen),
        .proxy_heads = static_cast<int>(pr.proxy_heads),
        .proxy_group = static_cast<int>(pr.proxy_heads / pr.proxy_kv_heads),
        .top_k = static_cast<int>(pr.top_k),
        .num_blocks = num_blocks,
        .buckets = buckets,
        .proxy_scale_log2 = pr.proxy_scale * kLog2e,
        .inv_rows = 0.f,
    };
    const sm80::MergeParams mp{
        .out = params.out,
        .lse = params.lse,
        .lse_proxy = params.lse_proxy,
        .o_part = ws.o_part,
        .lse_part = ws.lse_part,
        .lse_p_part = ws.lse_p_part,
        .kl_part = ws.kl_part,
        .kl_rows = ws.kl_rows,
        .indices = params.indices,
        .doc_start = index.doc_start,
        .chunk_begin = static_cast<int>(begin),
        .chunk_tokens = static_cast<int>(chunk),
        .chunk_end = static_cast<int>(end),
        .batch = static_cast<int>(pr.batch),
        .seqlen = static_cast<int>(pr.seqlen),
        .heads = static_cast<int>(pr.heads),
        .proxy_heads = static_cast<int>(pr.proxy_heads),
        .group = group,
        .top_k = static_cast<int>(pr.top_k),
    };
    // The teacher rows for the KL value: the main backward kernel in teacher mode, with the
    // chunk's final lse.
    const sm80::SparseBackwardParams tp{
        .q = params.q,
        .k = params.k,
        .index = index,
        .items = items,
        .lse = params.lse,
        .teacher = ws.teacher,
        .chunk_begin = static_cast<int>(begin),
        .chunk_tokens = static_cast<int>(chunk),
        .seqlen = static_cast<int>(pr.seqlen),
        .heads = static_cast<int>(pr.heads),
        .proxy_heads = static_cast<int>(pr.proxy_heads),
        .group = group,
        .kv_group = static_cast<int>(pr.heads / pr.kv_heads),
        .top_k = static_cast<int>(pr.top_k),
        .num_blocks = num_blocks,
        .buckets = buckets,
        .scale_log2 = pr.scale * kLog2e,
    };
    dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
      // The Hopper kernel takes the proxy lse along where Dp = 128.
      if (kDp == 128) fp.lse_p_part = ws.lse_p_part;
      const bool hopper = kD == 128 && sm90::launch_sparse_forward<T>(fp, stream);
      if (!hopper) sm80::launch_sparse_forward<T, kD>(fp, stream);
      if (!hopper || kDp != 128) sm80::launch_proxy<T, kDp, sm80::ProxyMode::kLse>(pp, stream);
      sm80::launch_merge<T, kD>(mp, stream);
      if (!kl) return;
      sm80::launch_sparse_backward<T, kD, true>(tp, stream);
      sm80::launch_proxy<T, kDp, sm80::ProxyMode::kKl>(pp, stream);
      sm80::launch_kl_rows(mp, stream);
    });
  }
  if (kl)
    sm80::launch_kl_reduce(ws.kl_rows, pr.batch * pr.proxy_heads * pr.seqlen, params.kl, stream);
}

int64_t kl_slots(const Problem& pr) { return pr.batch * pr.proxy_heads * pr.seqlen; }

size_t warmup_workspace_bytes(const Problem& pr) {
  // One fp32 KL term per (b, p, i), rounded up to keep the caller's 256-byte alignment.
  return (static_cast<size_t>(kl_slots(pr)) * sizeof(float) + 255) / 256 * 256;
}

void warmup_forward_impl(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, true);
  const Problem& pr = params.problem;
  check_attention_limits(pr, sm80::kMaxGroup);
  check_views(params);
  if (params.kl) {
    check_workspace_bytes(workspace.bytes, warmup_workspace_bytes(pr), "forward_workspace_bytes");
    check_workspace_pointer(workspace.data);
  }
  float* kl_partial = params.kl ? static_cast<float*>(workspace.data) : nullptr;
  const sm80::ForwardKernelParams kp{
      .q = params.q,
      .k = params.k,
      .v = params.v,
      .qp = params.qp,
      .kp = params.kp,
      .out = params.out,
      .lse = params.lse,
      .lse_proxy = params.lse_proxy,
      .kl_partial = kl_partial,
      .cu_seqlens = pr.cu_seqlens,
      .num_docs = static_cast<int>(pr.num_docs),
      .batch = static_cast<int>(pr.batch),
      .seqlen = static_cast<int>(pr.seqlen),
      .heads = static_cast<int>(pr.heads),
      .proxy_heads = static_cast<int>(pr.proxy_heads),
      .group = static_cast<int>(pr.heads / pr.proxy_heads),
      .kv_group = static_cast<int>(pr.heads / pr.kv_heads),
      .proxy_group = static_cast<int>(pr.proxy_heads / pr.proxy_kv_heads),
      .scale_log2 = pr.scale * kLog2e,
      .proxy_scale_log2 = pr.proxy_scale * kLog2e,
  };
  dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
    sm80::launch_forward<T, kD, kDp>(kp, stream);
  });
  if (params.kl) sm80::launch_kl_reduce(kl_partial, kl_slots(pr), params.kl, stream);
}

}  // namespace

size_t forward_workspace_bytes(const ForwardParams& params, bool warmup, int64_t max_chunk_tokens) {
  validate(params, warmup);
  return warmup ? warmup_workspace_bytes(params.problem)
                : sparse_workspace_bytes(params.problem, params.kl != nullptr, max_chunk_tokens);
}

void sparse_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  sparse_forward_impl(params, workspace, stream);
}

void warmup_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  warmup_forward_impl(params, workspace, stream);
}

}  // namespace flash_msa::cuda
