// Host entry of the sparse main-attention forward (SPEC sections 2, 3, 5): validation, the CUDA
// backend's limits, the plan (host/plan.h) and the launch sequence. Warmup lives in
// warmup/warmup.cu.
//
// Per call: the schedule's reverse index; then per token chunk its work items, the main kernel
// (per-block partial out and lse; forward/portable, or forward/sm90 where sparse_kernels() says
// kHopper, which with Dp = 128 also computes the proxy lse partials), the proxy kernel's lse
// partials otherwise, and the merge (passes/); with the KL value also the teacher rows, the
// proxy kernel's KL terms and their per-row sums, and finally the fixed-order reduction.
//
// The tile path (Hopper, Dp = 128, without the KL value): query tiles of 128 positions whose
// queries all selected the same blocks (schedule::Tiles; a selection made per query block, and the
// first tiles, whose queries select every visible block) run query-outer on the Hopper dense
// forward (forward/sm90/dense_sm90.h) over their blocks, which writes their out, lse and lse_proxy
// directly; their tokens get no edges, so the key-outer kernels and the merge skip them. It needs
// no partials and no merge for those tokens. The KL value's teacher pass walks the edges, so a call
// asking for the value keeps every token key-outer.
#include <cstdint>

#include "cuda/forward/portable/sparse_portable.h"
#include "cuda/forward/sm90/dense_sm90.h"
#include "cuda/forward/sm90/sparse_sm90.h"
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

// The sparse forward's arrays for chunks of `chunk` tokens per batch row.
struct Buffers {
  void* index;
  void* items;
  void* tiles;
  float* kl_rows;     // [B, Hp, Sq] (KL only)
  void* o_part;       // [chunk edges, G, D] dtype
  float* lse_part;    // [chunk edges, G]
  float* lse_p_part;  // [chunk edges]
  float* teacher;     // [chunk edges, 128] (KL only)
  float* kl_part;     // [chunk edges] (KL only)
};

// The layout function of SparsePlan; `out` (may be null) receives the arrays.
auto layout(const Problem& pr, bool kl, Buffers* out = nullptr) {
  return [&pr, kl, out](int64_t chunk, Carver& c) {
    const schedule::Shape shape{pr.batch, pr.seqlen,       pr.proxy_heads,
                                pr.top_k, pr.query_offset, pr.queries()};
    const int64_t edges = pr.batch * pr.proxy_heads * chunk * pr.top_k;
    const int64_t group = pr.heads / pr.proxy_heads;
    Buffers b{};
    b.index = c.take_bytes(schedule::index_workspace_bytes(shape));
    b.items = c.take_bytes(schedule::items_workspace_bytes(shape));
    b.tiles = c.take_bytes(schedule::tiles_workspace_bytes(shape));
    b.kl_rows = c.take<float>(kl ? pr.batch * pr.proxy_heads * pr.queries() : 0);
    b.o_part = c.take<uint16_t>(edges * group * pr.head_dim);
    b.lse_part = c.take<float>(edges * group);
    b.lse_p_part = c.take<float>(edges);
    b.teacher = c.take<float>(kl ? edges * kBlockSize : 0);
    b.kl_part = c.take<float>(kl ? edges : 0);
    if (out) *out = b;
  };
}

}  // namespace

size_t forward_workspace_bytes(const ForwardParams& params, bool warmup, int64_t max_chunk_tokens) {
  validate(params, warmup);
  if (warmup) return warmup::forward_workspace_bytes(params);
  return SparsePlan::workspace_bytes(params.problem, max_chunk_tokens,
                                     layout(params.problem, params.kl != nullptr));
}

void sparse_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params, false);
  const Problem& pr = params.problem;
  check_sparse_limits(pr);
  check_views(params);
  const bool kl = params.kl != nullptr;
  const SparsePlan plan =
      SparsePlan::for_workspace(pr, workspace.bytes, layout(pr, kl), "forward_workspace_bytes");
  Buffers ws{};
  plan.carve(workspace.data, layout(pr, kl, &ws));
  const KernelShape& shape = plan.shape();
  const SparseForwardVariant variant = sparse_forward_variant(pr, kl, current_chip());
  const bool hopper = variant.main.kernels == Kernels::kHopper, tile_path = variant.tile_path;
  schedule::Tiles tiles{};
  const schedule::Index index =
      schedule::build_index(plan.schedule_shape(), params.indices, pr.cu_seqlens, pr.num_docs,
                            ws.index, stream, tile_path ? ws.tiles : nullptr, &tiles);
  plan.for_each_chunk(
      index, ws.items, stream, [&](const Chunk& chunk, const schedule::Items& items) {
        portable::SparseForwardParams fp{
            .q = params.q,
            .k = params.k,
            .v = params.v,
            .qp = params.qp,
            .kp = params.kp,
            .index = index,
            .items = items,
            .o_part = ws.o_part,
            .lse_part = ws.lse_part,
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
            .lse_p_part = ws.lse_p_part,
            .kl_part = ws.kl_part,
            .shape = shape,
            .chunk = chunk,
        };
        const passes::MergeParams mp{
            .out = params.out,
            .lse = stats32(params.lse),
            .lse_proxy = stats32(params.lse_proxy),
            .o_part = ws.o_part,
            .lse_part = ws.lse_part,
            .lse_p_part = ws.lse_p_part,
            .kl_part = ws.kl_part,
            .kl_rows = ws.kl_rows,
            .indices = params.indices,
            .doc_start = index.doc_start,
            .tile_count = tiles.count,
            .shape = shape,
            .chunk = chunk,
        };
        // The teacher rows for the KL value, with the chunk's final lse.
        const portable::SparseBackwardParams tp{
            .q = params.q,
            .k = params.k,
            .index = index,
            .items = items,
            .lse = stats32(params.lse),
            .teacher = ws.teacher,
            .shape = shape,
            .chunk = chunk,
        };
        dispatch_attention(
            pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
              if (variant.proxy_in_main) fp.lse_p_part = ws.lse_p_part;
              if (hopper)
                sm90::launch_sparse_forward<T>(fp, stream);
              else
                portable::launch_sparse_forward<T, kD>(fp, stream);
              if (!variant.proxy_in_main)
                portable::launch_proxy<T, kDp, portable::ProxyMode::kLse>(pp, stream);
              passes::launch_merge<T, kD>(mp, stream);
              if (!kl) return;
              passes::launch_teacher<T, kD>(tp, stream);
              portable::launch_proxy<T, kDp, portable::ProxyMode::kKl>(pp, stream);
              passes::launch_kl_rows(mp, stream);
            });
      });
  if (kl) passes::launch_kl_reduce(ws.kl_rows, plan.shape(), stats32(params.kl), stream);
  if (tile_path) {
    const sm90::DenseForwardParams tp{
        .q = params.q,
        .k = params.k,
        .v = params.v,
        .qp = params.qp,
        .kp = params.kp,
        .out = params.out,
        .lse = stats32(params.lse),
        .lse_proxy = stats32(params.lse_proxy),
        .doc_start = index.doc_start,
        .tiles = tiles,
        .shape = shape,
    };
    dispatch_attention(pr.dtype, pr.head_dim, pr.proxy_head_dim, [&]<class T, int kD, int kDp>() {
      sm90::launch_dense_forward<T>(tp, stream);
    });
  }
}

}  // namespace flash_msa::cuda
