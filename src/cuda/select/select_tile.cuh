// Device parts of the proxy select that the portable kernel (portable/select_kernel.cuh) and
// the Hopper kernel (sm90/select_kernel.cuh) share: the shared layout of a 128-row tile and its
// loads, documents, the per-row top-K lists, the work split over query tiles and the sorted
// output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/mma_sm80.cuh"
#include "cuda/select/select_params.h"

namespace flash_msa::cuda::portable {

template <int kDp>
struct SelectTile {
  static_assert(kDp == 32 || kDp == 64 || kDp == 128, "supported proxy head dims");
  static constexpr int kChunks = kDp / 8;   // 16-byte chunks per row
  static constexpr int kKSteps = kDp / 16;  // mma k-steps per dot product
  static constexpr int kWarpRows = 32;      // two m16 tiles per warp share each key fragment
  static constexpr int kKeyGroup = 32;      // keys scored per pass: 2 x 4 accumulator tiles

  // XOR swizzle of 16-byte chunks so that the 8 row addresses of one ldmatrix hit distinct
  // banks; rows shorter than 128 bytes share a 128-byte line with their neighbours.
  static __device__ __forceinline__ int swizzle(int row, int chunk) {
    if constexpr (kChunks >= 8) {
      return chunk ^ (row & 7);
    } else {
      return chunk ^ ((row / (8 / kChunks)) & (kChunks - 1));
    }
  }
  static __device__ __forceinline__ int offset(int row, int chunk) {
    return row * kDp + swizzle(row, chunk) * 8;
  }
};

// Copies rows [lo, hi) of a 128-row tile into shared memory, row r from gmem + (r - lo) rows;
// the other rows are zero-filled. Every one of the CTA's kThreads threads takes part.
template <class T, int kDp, int kThreads = kSelectThreads>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t stride_s, int lo,
                                          int hi) {
  using Tile = SelectTile<kDp>;
  for (int x = threadIdx.x; x < kSelectBlockM * Tile::kChunks; x += kThreads) {
    const int row = x / Tile::kChunks, chunk = x % Tile::kChunks;
    const bool valid = row >= lo && row < hi;
    const T* src = valid ? gmem + (row - lo) * stride_s + chunk * 8 : gmem;
    cp_async_16(smem + Tile::offset(row, chunk), src, valid);
  }
}

// First token (within batch row b) of the document holding token i of that row.
__device__ __forceinline__ int doc_start(const SelectKernelParams& p, int b, int i) {
  if (p.cu_seqlens == nullptr) return 0;
  const int64_t row_base = int64_t(b) * p.shape.seqlen;
  const int64_t t = row_base + i;
  int lo = 0, hi = p.shape.num_docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.cu_seqlens[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t start = int64_t(p.cu_seqlens[lo]) - row_base;
  return static_cast<int>(start < 0 ? 0 : (start > i ? i : start));
}

// Per-row top-K list in shared memory, column `row` of a [K][kRows] array of {score bits,
// block} (kRows: the CTA's rows), owned by one lane. Blocks arrive in ascending order, so a
// newcomer enters only if strictly better than the current worst (ties keep the lower, older
// block); the evictee is the lowest score, highest block among equals. `thr` is the worst kept
// score once the list is full (-inf before), so -inf blocks never enter and most blocks cost
// one compare.
template <int kRows = kSelectBlockM>
struct TopKList {
  int2* entries;
  int top_k;
  int fill = 0;
  int worst = 0;
  float thr = -INFINITY;

  __device__ __forceinline__ void insert(float m, int n) {
    const int pos = fill < top_k ? fill++ : worst;
    entries[pos * kRows] = make_int2(__float_as_int(m), n);
    if (fill < top_k) return;
    float best = INFINITY;
    int best_block = -1;
#pragma unroll 8
    for (int x = 0; x < top_k; ++x) {
      const int2 e = entries[x * kRows];
      const float s = __int_as_float(e.x);
      if (s < best || (s == best && e.y > best_block)) {
        best = s;
        best_block = e.y;
        worst = x;
      }
    }
    thr = best;
  }

  // An entry of another list, over other blocks, in any block order (the Hopper kernel's cut
  // walks): it enters if it beats the worst kept, by a higher score or an equal score and a
  // lower block.
  __device__ __forceinline__ void merge(float m, int n) {
    if (fill == top_k && !(m > thr || (m == thr && n < entries[worst * kRows].y))) return;
    insert(m, n);
  }
};

// A CTA's work: the query tile of the 128 positions of key block `tile` for proxy head h of
// batch row b. Rows [lo, hi) of the tile are queries (all of it but at the ends of a query
// shard; none for a tile outside the queries); m0 is the position of row 0.
struct SelectWork {
  int b, h, tile, m0, lo, hi;
};

__device__ __forceinline__ SelectWork tile_work(const SelectKernelParams& p, int b, int h,
                                                int tile) {
  const int q_end = p.shape.query_offset + p.shape.queries;
  SelectWork w{b, h, tile, tile * kSelectBlockM, 0, 0};
  w.lo = min(max(p.shape.query_offset - w.m0, 0), kSelectBlockM);
  w.hi = max(min(kSelectBlockM, q_end - w.m0), w.lo);
  return w;
}

// The tile of CTA `cta` (blockIdx.x unless the caller numbers its CTAs otherwise) of the tiles
// that hold queries, for one CTA per tile and (b, h): heaviest tiles (largest causal bound)
// first, all heads of a tile together. kTiles consecutive tiles per CTA: the top one of the
// CTA's group (the group below it starts kTiles lower).
template <int kTiles = 1>
__device__ __forceinline__ SelectWork select_work(const SelectKernelParams& p,
                                                  unsigned cta = blockIdx.x) {
  const int heads = p.shape.batch * p.shape.proxy_heads;
  const int q_end = p.shape.query_offset + p.shape.queries;
  const int tile = (q_end - 1) / kSelectBlockM - kTiles * static_cast<int>(cta / heads);
  const int bh = static_cast<int>(cta % heads);
  return tile_work(p, bh / p.shape.proxy_heads, bh % p.shape.proxy_heads, tile);
}

// The grid of select_work<kTiles>: one CTA per kTiles query tiles, batch row and proxy head.
template <int kTiles = 1>
unsigned select_grid(const SelectKernelParams& params) {
  const int q_end = params.shape.query_offset + params.shape.queries;
  const int tiles = (q_end - 1) / kSelectBlockM - params.shape.query_offset / kSelectBlockM + 1;
  return static_cast<unsigned>((tiles + kTiles - 1) / kTiles) * params.shape.batch *
         params.shape.proxy_heads;
}

// Writes the rows [lo, hi) of the tile from their top-K lists (`entries`, columns of a
// [K][kRows] array; `fills`, the count of kept blocks per row, both complete in shared memory),
// sorted ascending: a kept block's slot is the number of kept blocks below it; the rest are -1.
// All kThreads threads.
template <int kThreads, int kRows = kSelectBlockM>
__device__ __forceinline__ void write_selection(const SelectKernelParams& p, const SelectWork& w,
                                                const int2* entries, const int32_t* fills) {
  const int k = p.shape.top_k;
  for (int x = threadIdx.x; x < (w.hi - w.lo) * k; x += kThreads) {
    const int row = w.lo + x / k, slot = x % k;
    int32_t* out = p.indices +
                   p.shape.query_row(int64_t(w.b) * p.shape.proxy_heads + w.h, w.m0 + row) * k;
    const int fill = fills[row];
    if (slot >= fill) {
      out[slot] = -1;
      continue;
    }
    const int32_t mine = entries[slot * kRows + row].y;
    int rank = 0;
    for (int y = 0; y < fill; ++y) rank += entries[y * kRows + row].y < mine;
    out[rank] = mine;
  }
}

}  // namespace flash_msa::cuda::portable
