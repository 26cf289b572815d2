// Portable proxy-select kernel (SPEC section 1) on mma.sync tensor cores: one CTA per
// (query tile of 128 rows, proxy head, batch row). The proxy query tile stays in registers; key
// blocks stream through a cp.async double buffer; each 128-key block is scored, masked, max-pooled
// per row and offered to a per-row top-K list in shared memory. The S x S scores never leave the
// chip. Tiles are scheduled longest first (the causal bound grows with the tile index). The
// Hopper kernel (select/sm90) shares the work split, the top-K lists and the output
// (select/select_tile.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/instantiate.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/host/check.h"
#include "cuda/select/portable/select_portable.h"
#include "cuda/select/select_tile.cuh"

namespace flash_msa::cuda::portable {

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
