// The scheduling stage of the sparse kernels (MSA paper sec. 4.2, "reverse index"): from the
// selection [B, Hp, S, K] it builds, on the device and in buffers sized by the shapes alone,
//  - the reverse index: every valid (b, p, token, slot) edge, bucketed by its key block
//    (b, p, n) and sorted by token inside the bucket (a radix sort, so the order is fixed);
//  - per token chunk, the work items of the key-block-outer kernels: runs of at most
//    kItemTokens tokens of one bucket, so that a block selected by every query (an attention
//    sink) is spread over many CTAs instead of serialising one;
//  - for the sparse forward's tile path (forward/forward.cu), the query tiles whose queries all
//    select the same blocks: those run query-outer, and their tokens get no edges.
// An edge is valid when its block n is visible to the token (first block of the token's
// document <= n <= the token's own block) and strictly above the previous valid entry of the
// row; the CPU backend rejects anything else, the CUDA kernels skip it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flash_msa::cuda::schedule {

inline constexpr int kItemTokens = 256;  // tokens of one bucket per work item
inline constexpr int kSlotBits = 6;      // an entry holds token << 6 | slot, so K <= 64
inline constexpr int64_t kMaxTokens = int64_t(1) << (31 - kSlotBits);  // S < 2^25

// The shape numbers the schedule depends on: S key positions per batch row, and the queries at
// positions [query_offset, query_offset + queries) (all of S without a query shard).
struct Shape {
  int64_t batch, seqlen, proxy_heads, top_k, query_offset, queries;
  int64_t num_blocks() const { return (seqlen + 127) / 128; }
  int64_t rows() const { return batch * proxy_heads * queries; }          // (b, p, query)
  int64_t edges() const { return rows() * top_k; }                        // (b, p, token, slot)
  int64_t buckets() const { return batch * proxy_heads * num_blocks(); }  // (b, p, block)
};

// The tile path's query tiles: tile n of index row bp = b * Hp + p holds the queries at
// positions 128 n .. 128 n + 127 (those of key block n) that the call has. It is listed when all
// of them have the same valid blocks (the same set; `valid_slots` in edges.cuh), as when a
// selection is made per 128-query block.
struct Tiles {
  const int32_t* blocks;        // [B * Hp * NB, K] tile bp * NB + n's blocks, ascending (listed)
  const int32_t* count;         // [B * Hp * NB] their number; 0: the tile is not listed
  const int32_t* listed;        // [B * Hp * NB] the listed tiles' numbers bp * NB + n, the first
                                // listed_count[0] of them, in no particular order
  const int32_t* listed_count;  // [1]
};

// The reverse index, in the workspace.
struct Index {
  const int32_t* doc_start;     // [B * S] first token of each token's document (in its row)
  const uint64_t* entries;      // [edges] bucket << 32 | token << 6 | slot, bucket-major,
                                // token-ascending; invalid edges (all ones) sorted last
  const int32_t* bucket_begin;  // [buckets + 1] first entry of each bucket; [buckets]: total
};

// Work items of one token chunk [chunk_begin, chunk_end) of every batch row, in the workspace.
struct Items {
  const int32_t* item_begin;   // [buckets + 1] first item of each bucket; [buckets]: total
  const int32_t* range_begin;  // [buckets] first entry of the bucket inside the chunk
  const int32_t* range_end;    // [buckets] one past its last entry inside the chunk
  int64_t max_items;           // upper bound of the total, the kernels' grid size
};

size_t index_workspace_bytes(const Shape& shape);
size_t items_workspace_bytes(const Shape& shape);
size_t tiles_workspace_bytes(const Shape& shape);
// Upper bound of the items of a chunk of `chunk_tokens` tokens per batch row.
int64_t max_items(const Shape& shape, int64_t chunk_tokens);

// doc_start[b * S + s] = the in-row position of the start of token s's document (0 without
// cu_seqlens [num_docs + 1]).
void launch_doc_start(const int32_t* cu_seqlens, int64_t num_docs, int64_t batch, int64_t seqlen,
                      int32_t* doc_start, cudaStream_t stream);

// indices [B, Hp, Sq, K] contiguous; cu_seqlens [num_docs + 1] or null; `workspace` holds
// index_workspace_bytes(shape), 256-byte aligned. With `tiles_workspace`
// (tiles_workspace_bytes(shape), 256-byte aligned) it also lists the tiles into it (*tiles) and
// leaves their queries' edges out of the index.
Index build_index(const Shape& shape, const int32_t* indices, const int32_t* cu_seqlens,
                  int64_t num_docs, void* workspace, cudaStream_t stream,
                  void* tiles_workspace = nullptr, Tiles* tiles = nullptr);
Items build_items(const Shape& shape, const Index& index, int64_t chunk_begin, int64_t chunk_end,
                  void* workspace, cudaStream_t stream);

}  // namespace flash_msa::cuda::schedule
