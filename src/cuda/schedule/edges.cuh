// Device-side reading of the schedule, shared by the stage that builds it and the kernels that
// walk it: which slots of an index row are edges, how entries pack, and which bucket and entry
// range a work item covers.
#pragma once

#include <cstdint>

#include "cuda/common/shape.h"
#include "cuda/schedule/schedule.h"

namespace flash_msa::cuda::schedule {

// Bitmask of the valid slots of one index row (SPEC: ascending visible blocks; anything else
// is skipped): first_block <= n <= own_block and n above the previous valid entry.
__device__ __forceinline__ uint64_t valid_slots(const int32_t* row, int top_k, int own_block,
                                                int first_block) {
  uint64_t mask = 0;
  int prev = -1;
  for (int k = 0; k < top_k; ++k) {
    const int n = __ldg(row + k);
    if (n >= first_block && n <= own_block && n > prev) {
      mask |= uint64_t(1) << k;
      prev = n;
    }
  }
  return mask;
}

__device__ __forceinline__ int entry_token(uint64_t entry) {
  return static_cast<int>(static_cast<uint32_t>(entry) >> kSlotBits);
}
__device__ __forceinline__ int entry_slot(uint64_t entry) {
  return static_cast<int>(static_cast<uint32_t>(entry) & ((1u << kSlotBits) - 1));
}

// Where the partial results of `entry` (of bucket row bp = b * Hp + p) live in a chunk's
// buffers: the chunk-local edge ((b * Hp + p) * chunk.tokens + token - chunk.begin) * K + slot.
__device__ __forceinline__ int64_t chunk_edge(int bp, const Chunk& chunk, int top_k,
                                              uint64_t entry) {
  return (int64_t(bp) * chunk.tokens + entry_token(entry) - chunk.begin) * top_k +
         entry_slot(entry);
}

// A work item: entries [begin, end) of bucket (bp, block), bp = b * Hp + p, and where its
// block and heads start.
struct Item {
  int bp, block, begin, end;
  int b;      // batch row
  int ph;     // proxy head p
  int head0;  // first main head of the proxy group, p * G
  int key0;   // first key of the block, block * 128
};

// The prologue of every key-block-outer kernel: item `item` of a chunk, or false past the
// chunk's last item (the CTA then has nothing to do).
__device__ __forceinline__ bool find_item(const Items& items, const KernelShape& shape, int item,
                                          Item& out) {
  if (item >= __ldg(items.item_begin + shape.buckets)) return false;
  int lo = 0, hi = shape.buckets;  // item_begin[lo] <= item < item_begin[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldg(items.item_begin + mid) <= item)
      lo = mid;
    else
      hi = mid;
  }
  const int begin =
      __ldg(items.range_begin + lo) + (item - __ldg(items.item_begin + lo)) * kItemTokens;
  const int bp = lo / shape.num_blocks, block = lo % shape.num_blocks;
  const int ph = bp % shape.proxy_heads;
  out = {bp,
         block,
         begin,
         min(begin + kItemTokens, __ldg(items.range_end + lo)),
         bp / shape.proxy_heads,
         ph,
         ph * shape.group,
         block * 128};
  return true;
}

// The entries of a work item decoded once, for kernels that keep them in shared memory: row
// e - item.begin holds entry e's token, the first token of its document and its chunk edge.
struct ItemRows {
  int token[kItemTokens];
  int first[kItemTokens];
  int64_t edge[kItemTokens];
};

// Fills `rows` for `item` with threads [0, kThreads); the caller synchronises before reading.
// Params: a sparse kernel's parameters (index, shape, chunk).
template <int kThreads, class Params>
__device__ __forceinline__ void load_item_rows(ItemRows& rows, const Item& item, const Params& p,
                                               int thread) {
  const int32_t* doc_start = p.index.doc_start + int64_t(item.b) * p.shape.seqlen;
  for (int t = thread; t < item.end - item.begin; t += kThreads) {
    const uint64_t entry = p.index.entries[item.begin + t];
    const int token = entry_token(entry);
    rows.token[t] = token;
    rows.first[t] = __ldg(doc_start + token);
    rows.edge[t] = chunk_edge(item.bp, p.chunk, p.shape.top_k, entry);
  }
}

// A query tile of kRows rows holds floor(kRows / G) tokens of G heads (G query heads per proxy
// head): row r is head r % G of the tile's token r / G. Built once per CTA, so that the
// per-tile gathers and row lookups divide nothing; the tile at item row t0 reads item row
// t0 + row[r].token, none where that reaches the item's end.
template <int kRows>
struct TileRows {
  struct Row {
    int token;      // r / G; kItemTokens (past every item) for rows past floor(kRows / G) G
    uint32_t head;  // r % G
  };
  Row row[kRows];

  // The token of row r of the tile at item row t0 of an item of `item_rows` rows (`items`),
  // clamped into the item; `valid`: the row lies inside it.
  __device__ __forceinline__ uint32_t token_of(const ItemRows& items, int t0, int r, int item_rows,
                                               bool& valid) const {
    const int t = t0 + row[r].token;
    valid = t < item_rows;
    return uint32_t(items.token[min(t, item_rows - 1)]);
  }
};

// Fills `tile` with threads [0, kThreads); the caller synchronises before reading.
template <int kRows, int kThreads>
__device__ __forceinline__ void fill_tile_rows(TileRows<kRows>& tile, int group, int thread) {
  for (int r = thread; r < kRows; r += kThreads)
    tile.row[r] = {r / group < kRows / group ? r / group : kItemTokens, uint32_t(r % group)};
}

}  // namespace flash_msa::cuda::schedule
