// Hopper (wgmma) proxy-select kernel of MSA (SPEC section 1): the portable kernel's work
// (select/portable/select_kernel.cuh: query tiles of 128 rows, heaviest first; masks; per-row
// top-K lists; sorted output) on warpgroup tensor cores.
//
// One CTA takes two neighbouring query tiles of one proxy head and batch row, 256 rows, so that
// each key block it reads from L2 serves twice the rows of the portable kernel: warpgroup w
// takes tile t_lo + w as two m64 row tiles, whose rows stay in registers as the A operand of
// S = Qp Kp^T (m64n128k16, K-major keys from shared memory), loaded once. Key blocks stream
// through a ring of three shared buffers (SW128 panels, wgmma_sm90.cuh), copied by cp.async two
// blocks ahead. Per block, a warpgroup issues both row tiles' products, max-pools the first while
// the second is on the tensor cores and offers the row maxima to the top-K lists, then pools the
// second while the other warpgroup's products run. Nothing is in flight across blocks: the
// buffer refilled at block n held block n - 1, which every warpgroup finished before the
// barrier of block n. The lower tile's warpgroup also scores the upper tile's own block, all of
// whose keys lie in its future: masked, it changes nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/warp_reduce.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/host/impl.h"
#include "cuda/select/portable/select_kernel.cuh"

namespace flash_msa::cuda::sm90::block_select {

using portable::kBlockKeys;
using portable::kSelectBlockM;

inline constexpr int kTiles = 2;                      // query tiles per CTA, one per warpgroup
inline constexpr int kRows = kTiles * kSelectBlockM;  // rows per CTA
inline constexpr int kThreads = 256;                  // two warpgroups
inline constexpr int kStages = 3;                     // key-block buffers

// Dynamic shared memory: 1024 bytes of slack to align the start, the ring of key blocks
// ([128, Dp] SW128 panels each), then a region that first holds the CTA's query rows (the
// portable kernel's tile layout, one tile after the other, read once into registers) and then
// the per-row top-K lists (entries [K][256] of {score bits, block}, fill counts [256] int32):
// 226 KiB at Dp = 128 and K = 64.
template <int kDp>
struct SharedMemory {
  static constexpr int kStageBytes = kBlockKeys * kDp * 2;
  static constexpr int kRegion = kStages * kStageBytes;  // offset of the region
  static constexpr int kQueryBytes = kRows * kDp * 2;
  static constexpr int fills_offset(int top_k) { return top_k * kRows * 8; }
  static constexpr int bytes(int top_k) {
    const int lists = fills_offset(top_k) + kRows * 4;
    return 1024 + kRegion + (lists > kQueryBytes ? lists : kQueryBytes);
  }
};

template <class T, int kDp>
__global__ void __launch_bounds__(kThreads, 1) select_kernel(const portable::SelectKernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = SharedMemory<kDp>;
  using Tile = portable::SelectTile<kDp>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* region = smem + Smem::kRegion;
  T* qrows = reinterpret_cast<T*>(region);
  int2* entries = reinterpret_cast<int2*>(region);
  int32_t* fills = reinterpret_cast<int32_t*>(region + Smem::fills_offset(p.shape.top_k));

  // The CTA's tiles t_lo = t_hi - 1 (below the queries, or -1, at the bottom end: no rows
  // then) and t_hi; this warpgroup's tile.
  const portable::SelectWork upper = portable::select_work<kTiles>(p);
  const int b = upper.b, t_hi = upper.tile;
  const int wg = warpgroup_index();
  const portable::SelectWork mine = portable::tile_work(p, b, upper.h, t_hi - 1 + wg);
  const T* qp = static_cast<const T*>(p.qp.data) + b * p.qp.stride_b + upper.h * p.qp.stride_h;
  const T* k_gmem = static_cast<const T*>(p.kp.data) + b * p.kp.stride_b +
                    (upper.h / p.shape.proxy_group) * p.kp.stride_h;
  const int m0 = (t_hi - 1) * kSelectBlockM;  // position of the CTA's row 0
  const int n_first = portable::doc_start(p, b, max(m0, 0)) / kBlockKeys;
  const int lo_last = portable::doc_start(p, b, upper.m0 + upper.hi - 1);

  // Key block n (n <= t_hi) into its buffer, keys past the sequence zero-filled; one cp.async
  // group per call, empty past the last block, so that "all but the newest group" is the block
  // needed next.
  auto load_block = [&](int n) {
    if (n <= t_hi) {
      const int key0 = n * kBlockKeys;
      copy_rows_sw128<kBlockKeys, kDp, kThreads>(
          smem + (n % kStages) * Smem::kStageBytes,
          [&](int r, bool& valid) {
            valid = key0 + r < p.shape.seqlen;
            return k_gmem + int64_t(min(key0 + r, p.shape.seqlen - 1)) * p.kp.stride_s;
          },
          threadIdx.x);
    }
    cp_async_commit();
  };
  // The query rows of both tiles (zero where no query), every thread taking part in each copy.
#pragma unroll
  for (int w = 0; w < kTiles; ++w) {
    const portable::SelectWork tw = portable::tile_work(p, b, upper.h, t_hi - 1 + w);
    const int first = tw.hi > tw.lo ? p.shape.query_at(tw.m0 + tw.lo) : 0;
    portable::load_tile<T, kDp, kThreads>(qrows + w * kSelectBlockM * kDp,
                                          qp + int64_t(first) * p.qp.stride_s, p.qp.stride_s, tw.lo,
                                          tw.hi);
  }
  load_block(n_first);  // one group with the query rows
  load_block(n_first + 1);

  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  // This thread's accumulator rows of row tile mt: 64 mt + 16 warp + lane / 4 + 8 h (h = 0, 1)
  // of the warpgroup's tile; their positions and first visible keys (document starts).
  int row_i[2][2], row_lo[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_i[mt][h] = mine.m0 + 64 * mt + 16 * warp + lane / 4 + 8 * h;
      row_lo[mt][h] = portable::doc_start(p, b, min(max(row_i[mt][h], 0), p.shape.seqlen - 1));
    }
  // Lane 4 r + 2 mt + h owns the list of row h of row tile mt; rows that are no query never
  // insert.
  const int my_mt = lane % 4 / 2, my_h = lane % 2;
  const int my_row = 64 * my_mt + 16 * warp + lane / 4 + 8 * my_h;  // of the warpgroup's tile
  portable::TopKList<kRows> list{entries + kSelectBlockM * wg + my_row, p.shape.top_k};
  if (my_row < mine.lo || my_row >= mine.hi) list.thr = INFINITY;

  cp_async_wait<1>();
  __syncthreads();  // the query rows are in place
  // A fragments of this warp's 16 rows of each row tile, as for mma.m16n8k16.
  uint32_t qa[2][kDp / 16][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int kk = 0; kk < kDp / 16; ++kk)
      ldmatrix_x4(qa[mt][kk],
                  qrows + Tile::offset(kSelectBlockM * wg + 64 * mt + 16 * warp + (lane & 15),
                                       kk * 2 + (lane >> 4)));
  // The top-K lists overwrite the query rows: the first insertion follows the barrier of the
  // first block, which every warp reaches after its fragment loads.

  const uint64_t ring_desc = sw128_desc(smem_addr(smem), 16, 1024);
  // S = Qp Kp^T of row tile mt over the block in buffer `keys`, one commit group.
  auto issue = [&](float(&acc)[64], const uint32_t(&a)[kDp / 16][4], uint64_t keys) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDp / 16; ++kk)
      wgmma_m64n128k16_rs<T>(acc, a[kk],
                             desc_add(keys, (kk / 4) * kBlockKeys * 128 + (kk % 4) * 32), kk > 0);
    wgmma_commit();
  };
  // Block n's row maxima of row tile mt (masked where a row sees only part of the block: from
  // the own block on, and blocks cut by a document start), scaled (proxy_scale > 0 and rounding
  // is monotone: the maximum of the scaled scores bit for bit), offered to the lists of the
  // tile's owners; the own block always enters.
  auto pool = [&](float(&acc)[64], int mt, int n) {
    const int key0 = n * kBlockKeys;
    if (n >= mine.tile || key0 < lo_last) {
      int lo[2], hi[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        lo[h] = row_lo[mt][h] - key0 - 2 * (lane % 4);
        hi[h] = row_i[mt][h] - key0 - 2 * (lane % 4);
      }
      mask_columns(acc, lo, hi);
    }
    // Four independent chains per row, combined at the end.
    float mc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int x = 0; x < 4; ++x) mc[h][x] = -INFINITY;
#pragma unroll
    for (int j = 0; j < 64; ++j)
      mc[(j % 4) / 2][(j / 4) % 4] = fmaxf(mc[(j % 4) / 2][(j / 4) % 4], acc[j]);
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      mx[h] = quad_max(fmaxf(fmaxf(mc[h][0], mc[h][1]), fmaxf(mc[h][2], mc[h][3])));
    if (my_mt != mt) return;
    float m = p.shape.proxy_scale * (my_h == 0 ? mx[0] : mx[1]);
    if (n == mine.tile) m = INFINITY;
    if (m > list.thr) list.insert(m, n);
  };

  for (int n = n_first; n <= t_hi; ++n) {
    cp_async_wait<1>();
    fence_async_shared();
    __syncthreads();  // block n is in place; every warpgroup is done with block n - 1
    load_block(n + 2);
    const uint64_t keys = desc_add(ring_desc, (n % kStages) * Smem::kStageBytes);
    float acc[2][64];
    issue(acc[0], qa[0], keys);
    issue(acc[1], qa[1], keys);
    wgmma_wait<1>();
    fence_operands(acc[0]);
    pool(acc[0], 0, n);
    wgmma_wait<0>();
    fence_operands(acc[1]);
    pool(acc[1], 1, n);
  }

  fills[kSelectBlockM * wg + my_row] = list.fill;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kTiles; ++w)
    portable::write_selection<kThreads, kRows>(p, portable::tile_work(p, b, upper.h, t_hi - 1 + w),
                                               entries + kSelectBlockM * w,
                                               fills + kSelectBlockM * w);
#else
  __trap();  // built without sm_90a code: select_kernels() never picks it then
#endif
}

}  // namespace flash_msa::cuda::sm90::block_select

namespace flash_msa::cuda::sm90 {

template <class T, int kDp>
void launch_select(const portable::SelectKernelParams& params, cudaStream_t stream) {
  using namespace block_select;
  launch_large_smem(select_kernel<T, kDp>, portable::select_grid<kTiles>(params), kThreads,
                    SharedMemory<kDp>::bytes(params.shape.top_k), params, stream);
}

}  // namespace flash_msa::cuda::sm90
