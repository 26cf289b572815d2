// Portable proxy-select kernel (SPEC section 1) on mma.sync tensor cores: one CTA per
// (query tile of 128 rows, proxy head, batch row). The proxy query tile stays in registers; key
// blocks stream through a cp.async double buffer; each 128-key block is scored, masked, max-pooled
// per row and offered to a per-row top-K list in shared memory. The S x S scores never leave the
// chip. Tiles are scheduled longest first (the causal bound grows with the tile index). The
// Hopper kernel (select/sm90) shares the work split, the top-K lists and the output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/instantiate.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/host/check.h"
#include "cuda/select/portable/select_portable.h"

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

// Row maxima of <q, k> over one 128-key block for the thread's accumulator rows: mx[mt][half]
// covers row warp*32 + mt*16 + lane/4 + half*8 (before the quad reduction). kMask applies
// visibility (lo[slot] <= j <= i[slot]); interior blocks skip it.
template <class T, int kDp, bool kMask>
__device__ __forceinline__ void block_row_max(float (&mx)[2][2], const T* ktile,
                                              const uint32_t (&qa)[2][kDp / 16][4], int key0,
                                              const int (&row_i)[4], const int (&row_lo)[4]) {
  using Tile = SelectTile<kDp>;
  const int lane = threadIdx.x & 31;
  const int ld_row = (lane & 7) + ((lane >> 4) << 3);
  const int ld_chunk = (lane >> 3) & 1;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) mx[mt][0] = mx[mt][1] = -INFINITY;
#pragma unroll
  for (int g = 0; g < kBlockKeys / Tile::kKeyGroup; ++g) {
    float acc[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tile::kKSteps; ++kk) {
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const int key = g * Tile::kKeyGroup + pair * 16 + ld_row;
        uint32_t b[4];
        ldmatrix_x4(b, ktile + Tile::offset(key, kk * 2 + ld_chunk));
        const uint32_t b_lo[2] = {b[0], b[1]};
        const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_16x8x16<T>(acc[mt][pair * 2], qa[mt][kk], b_lo);
          mma_16x8x16<T>(acc[mt][pair * 2 + 1], qa[mt][kk], b_hi);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float s = acc[mt][nt][e];
          if constexpr (kMask) {
            const int slot = mt * 2 + (e >> 1);
            const int j = key0 + g * Tile::kKeyGroup + nt * 8 + 2 * (lane & 3) + (e & 1);
            if (j < row_lo[slot] || j > row_i[slot]) s = -INFINITY;
          }
          mx[mt][e >> 1] = fmaxf(mx[mt][e >> 1], s);
        }
  }
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

template <class T, int kDp>
__global__ void __launch_bounds__(kSelectThreads) select_kernel(const SelectKernelParams p) {
  using Tile = SelectTile<kDp>;
  extern __shared__ __align__(128) unsigned char smem[];
  const SelectSmemPlan plan{kDp, p.shape.top_k};
  auto ktile = [&](int buf) { return reinterpret_cast<T*>(smem + plan.key_tile_offset(buf)); };
  T* qtile = reinterpret_cast<T*>(smem + plan.region_offset());
  int2* entries = reinterpret_cast<int2*>(smem + plan.entries_offset());
  int32_t* fills = reinterpret_cast<int32_t*>(smem + plan.fill_offset());

  const SelectWork work = select_work(p);
  const int b = work.b, h = work.h, tile = work.tile, m0 = work.m0, lo = work.lo, hi = work.hi;

  const T* q_gmem = static_cast<const T*>(p.qp.data) + b * p.qp.stride_b + h * p.qp.stride_h +
                    int64_t(p.shape.query_at(m0 + lo)) * p.qp.stride_s;
  const T* k_gmem = static_cast<const T*>(p.kp.data) + b * p.kp.stride_b +
                    (h / p.shape.proxy_group) * p.kp.stride_h;

  const int n_first = doc_start(p, b, m0) / kBlockKeys;
  const int lo_last = doc_start(p, b, m0 + hi - 1);

  load_tile<T, kDp>(qtile, q_gmem, p.qp.stride_s, lo, hi);
  cp_async_commit();
  load_tile<T, kDp>(ktile(0), k_gmem + int64_t(n_first) * kBlockKeys * p.kp.stride_s, p.kp.stride_s,
                    0, min(kBlockKeys, p.shape.seqlen - n_first * kBlockKeys));
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Accumulator row slots of this thread: slot = mt * 2 + half.
  int row_i[4], row_lo[4];
#pragma unroll
  for (int slot = 0; slot < 4; ++slot) {
    const int row = warp * Tile::kWarpRows + (slot >> 1) * 16 + (lane >> 2) + (slot & 1) * 8;
    row_i[slot] = m0 + row;
    row_lo[slot] = doc_start(p, b, min(m0 + row, p.shape.seqlen - 1));
  }
  const int my_slot = lane & 3;
  const int my_row = warp * Tile::kWarpRows + (my_slot >> 1) * 16 + (lane >> 2) + (my_slot & 1) * 8;
  TopKList<> list{entries + my_row, p.shape.top_k};
  if (my_row < lo || my_row >= hi) list.thr = INFINITY;  // rows that are no query never insert

  cp_async_wait<1>();
  __syncthreads();
  uint32_t qa[2][Tile::kKSteps][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int kk = 0; kk < Tile::kKSteps; ++kk)
      ldmatrix_x4(qa[mt][kk], qtile + Tile::offset(warp * Tile::kWarpRows + mt * 16 + (lane & 15),
                                                   kk * 2 + (lane >> 4)));
  // The top-K lists overwrite the query tile: the barrier of the first iteration orders every
  // warp's fragment loads before the first insertion.

  for (int n = n_first; n <= tile; ++n) {
    const int buf = (n - n_first) & 1;
    if (n < tile) {
      const int next = (n + 1) * kBlockKeys;
      load_tile<T, kDp>(ktile(buf ^ 1), k_gmem + int64_t(next) * p.kp.stride_s, p.kp.stride_s, 0,
                        min(kBlockKeys, p.shape.seqlen - next));
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    float mx[2][2];
    const int key0 = n * kBlockKeys;
    // Only the own (diagonal) block and blocks cut by a document start need the mask.
    if (n == tile || key0 < lo_last) {
      block_row_max<T, kDp, true>(mx, ktile(buf), qa, key0, row_i, row_lo);
    } else {
      block_row_max<T, kDp, false>(mx, ktile(buf), qa, key0, row_i, row_lo);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        mx[mt][hf] = fmaxf(mx[mt][hf], __shfl_xor_sync(0xffffffffu, mx[mt][hf], 1));
        mx[mt][hf] = fmaxf(mx[mt][hf], __shfl_xor_sync(0xffffffffu, mx[mt][hf], 2));
      }
    // proxy_scale > 0 (validated) and rounding is monotone, so scaling the maximum equals the
    // maximum of the scaled scores bit for bit.
    float m = p.shape.proxy_scale * (my_slot == 0   ? mx[0][0]
                                     : my_slot == 1 ? mx[0][1]
                                     : my_slot == 2 ? mx[1][0]
                                                    : mx[1][1]);
    if (n == tile) m = INFINITY;  // the own block is always selected
    if (m > list.thr) list.insert(m, n);
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }

  fills[my_row] = list.fill;
  __syncthreads();
  write_selection<kSelectThreads>(p, work, entries, fills);
}

template <class T, int kDp>
void launch_select(const SelectKernelParams& params, cudaStream_t stream) {
  const size_t smem = SelectSmemPlan{kDp, params.shape.top_k}.bytes();
  FLASH_MSA_CUDA_CHECK(cudaFuncSetAttribute(
      select_kernel<T, kDp>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  select_kernel<T, kDp><<<select_grid(params), kSelectThreads, smem, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::portable

// One explicit instantiation for element type T (FLASH_MSA_INSTANTIATE, common/instantiate.h).
#define FLASH_MSA_SELECT_DIM(T, DP) \
  template void launch_select<T, DP>(const SelectKernelParams&, cudaStream_t);
