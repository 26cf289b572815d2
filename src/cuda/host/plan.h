// The plan of a call, computed once from the shapes: the kernels' shape numbers, the carving of
// the caller's workspace into 256-byte aligned arrays, and the token chunks of the sparse
// passes. The same code sizes a workspace (*_workspace_bytes, from a null base: only counts)
// and lays it out for the launches, so the two cannot disagree.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/common/shape.h"
#include "cuda/host/limits.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/cuda.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;

// A statistics pointer of the params (lse, lse_proxy, kl, kl_grad) as the kernels read it:
// float32, the stats dtype (msa.h) of bf16 and fp16.
inline float* stats32(void* p) { return static_cast<float*>(p); }
inline const float* stats32(const void* p) { return static_cast<const float*>(p); }

// The shape numbers every kernel of a call reads (after validation and the backend's limits,
// which keep them in int32).
inline KernelShape kernel_shape(const Problem& pr) {
  const int64_t num_blocks = (pr.seqlen + kBlockSize - 1) / kBlockSize;
  return {
      .batch = static_cast<int>(pr.batch),
      .seqlen = static_cast<int>(pr.seqlen),
      .heads = static_cast<int>(pr.heads),
      .proxy_heads = static_cast<int>(pr.proxy_heads),
      .group = static_cast<int>(pr.heads / pr.proxy_heads),
      .kv_group = static_cast<int>(pr.heads / pr.kv_heads),
      .proxy_group = static_cast<int>(pr.proxy_heads / pr.proxy_kv_heads),
      .head_dim = static_cast<int>(pr.head_dim),
      .proxy_head_dim = static_cast<int>(pr.proxy_head_dim),
      .top_k = static_cast<int>(pr.top_k),
      .num_blocks = static_cast<int>(num_blocks),
      .buckets = static_cast<int>(pr.batch * pr.proxy_heads * num_blocks),
      .num_docs = static_cast<int>(pr.num_docs),
      .scale = pr.scale,
      .proxy_scale = pr.proxy_scale,
      .scale_log2 = pr.scale * kLog2e,
      .proxy_scale_log2 = pr.proxy_scale * kLog2e,
      .inv_rows = static_cast<float>(1.0 / (double(pr.batch) * pr.proxy_heads * pr.seqlen)),
      .query_offset = static_cast<int>(pr.query_offset),
      .queries = static_cast<int>(pr.queries()),
  };
}

class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<unsigned char*>(base)) {}
  template <class T>
  T* take(int64_t count) {
    T* at = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  void* take_bytes(size_t bytes) { return take<unsigned char>(static_cast<int64_t>(bytes)); }
  size_t used() const { return used_; }

 private:
  unsigned char* base_;
  size_t used_ = 0;
};

// Bytes of a layout: `layout(carver)` carves a stage's arrays in order.
template <class Layout>
size_t layout_bytes(const Layout& layout) {
  Carver c(nullptr);
  layout(c);
  return c.used();
}

// Checks that `workspace` holds the arrays of `layout` (else the error names the public
// `sizing_function`) and carves them.
template <class Layout>
void carve_workspace(const Workspace& workspace, const Layout& layout,
                     const char* sizing_function) {
  check_workspace_bytes(workspace.bytes, layout_bytes(layout), sizing_function);
  check_workspace_pointer(workspace.data);
  Carver c(workspace.data);
  layout(c);
}

// The token chunks of a sparse pass (forward or backward) and its workspace. A stage describes
// its arrays by a layout function `layout(chunk, carver)` for chunks of `chunk` query tokens per
// batch row: the schedule's index and work items (which grow with S), accumulators over S, and
// the per-token partial buffers (which grow with the chunk). Chunks cover the queries' positions
// (all of S, or a query shard's).
class SparsePlan {
 public:
  // The plan the launches follow, for a workspace of `bytes`: the largest chunk whose arrays fit,
  // evened out so that no chunk is a short tail (which would run every kernel of its pass at a
  // fraction of the GPU). Throws the workspace error, naming `sizing_function`, when the
  // smallest chunk does not fit.
  template <class Layout>
  static SparsePlan for_workspace(const Problem& pr, size_t bytes, const Layout& layout,
                                  const char* sizing_function) {
    const int64_t chunk = even_chunk(pr.queries(), largest_chunk(pr, bytes, layout));
    const int64_t smallest = std::min<int64_t>(pr.queries(), kBlockSize);
    if (chunk < smallest)
      check_workspace_bytes(bytes, chunk_bytes(layout, smallest), sizing_function);
    return SparsePlan(pr, chunk);
  }

  // The workspace *_workspace_bytes reports: chunks of at most max_chunk_tokens (rounded down to
  // a multiple of 128, at least 128) or, when 0, what the smallest chunk needs plus
  // kDefaultChunkBytes of per-token partials (the whole sequence when that holds it).
  template <class Layout>
  static size_t workspace_bytes(const Problem& pr, int64_t max_chunk_tokens, const Layout& layout) {
    const int64_t smallest = std::min<int64_t>(pr.queries(), kBlockSize);
    const int64_t chunk =
        max_chunk_tokens > 0
            ? max_chunk_tokens / kBlockSize * kBlockSize
            : largest_chunk(pr, chunk_bytes(layout, smallest) + kDefaultChunkBytes, layout);
    return chunk_bytes(layout, std::min(std::max(chunk, smallest), pr.queries()));
  }

  // The stage's arrays in `workspace`, laid out for this plan's chunks.
  template <class Layout>
  void carve(void* workspace, const Layout& layout) const {
    check_workspace_pointer(workspace);
    Carver c(workspace);
    layout(chunk_tokens_, c);
  }

  // Runs f(chunk, items) for each chunk in order, after building the chunk's work items.
  template <class F>
  void for_each_chunk(const schedule::Index& index, void* items_workspace, cudaStream_t stream,
                      F&& f) const {
    const int64_t first = shape_.query_offset, last = first + shape_.queries;
    for (int64_t begin = first; begin < last; begin += chunk_tokens_) {
      const int64_t end = std::min<int64_t>(last, begin + chunk_tokens_);
      const schedule::Items items =
          schedule::build_items(schedule_, index, begin, end, items_workspace, stream);
      f(Chunk{static_cast<int>(begin), static_cast<int>(chunk_tokens_), static_cast<int>(end)},
        items);
    }
  }

  const KernelShape& shape() const { return shape_; }
  const schedule::Shape& schedule_shape() const { return schedule_; }

 private:
  // Per-token partial buffers of the default workspace, beyond what the smallest chunk needs.
  static constexpr size_t kDefaultChunkBytes = size_t(8) << 30;

  SparsePlan(const Problem& pr, int64_t chunk_tokens)
      : shape_(kernel_shape(pr)),
        schedule_{pr.batch, pr.seqlen, pr.proxy_heads, pr.top_k, pr.query_offset, pr.queries()},
        chunk_tokens_(chunk_tokens) {}

  template <class Layout>
  static size_t chunk_bytes(const Layout& layout, int64_t chunk) {
    return layout_bytes([&](Carver& c) { layout(chunk, c); });
  }

  // The largest chunk (all of S, or a multiple of 128) whose arrays fit in `bytes`; 0 if none.
  // The arrays grow linearly with the chunk once it holds any token (a per-bucket term of the
  // work items comes in at the first one), so the step between 128 and 256 tokens gives the
  // slope.
  template <class Layout>
  static int64_t largest_chunk(const Problem& pr, size_t bytes, const Layout& layout) {
    const int64_t S = pr.queries();
    if (chunk_bytes(layout, S) <= bytes) return S;
    const size_t first = chunk_bytes(layout, kBlockSize);
    const size_t per_block = chunk_bytes(layout, 2 * kBlockSize) - first;
    if (bytes < first) return 0;
    int64_t chunk =
        std::min<int64_t>(static_cast<int64_t>(1 + (bytes - first) / per_block) * kBlockSize,
                          S / kBlockSize * kBlockSize);
    while (chunk > 0 && chunk_bytes(layout, chunk) > bytes) chunk -= kBlockSize;
    return chunk;
  }

  // As few chunks as chunks of at most `max_chunk` tokens (a multiple of 128) allow, all of one
  // size (a multiple of 128). Chunks that fit in one (or no) chunk are returned as they are.
  static int64_t even_chunk(int64_t seqlen, int64_t max_chunk) {
    if (max_chunk <= 0 || max_chunk >= seqlen) return max_chunk;
    const int64_t chunks = (seqlen + max_chunk - 1) / max_chunk;
    return ((seqlen + chunks - 1) / chunks + 127) / 128 * 128;
  }

  KernelShape shape_;
  schedule::Shape schedule_;
  int64_t chunk_tokens_;
};

}  // namespace flash_msa::cuda
