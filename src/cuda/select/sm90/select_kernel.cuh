// Hopper (wgmma) proxy-select kernel of MSA (SPEC section 1): the portable kernel's work
// (select/portable/select_kernel.cuh: query tiles of 128 rows, heaviest first; masks; per-row
// top-K lists; sorted output) on warpgroup tensor cores.
//
// One CTA takes two neighbouring query tiles of one proxy head and batch row, 256 rows, so that
// each key block it reads from L2 serves twice the rows of the portable kernel: warpgroup w of
// four takes the m64 row tile w % 2 of tile t_lo + w / 2, whose rows stay in registers as the A
// operand of S = Qp Kp^T (m64n128k16, K-major keys from shared memory), loaded once. Key blocks
// stream through a ring of three shared buffers (SW128 panels, wgmma_sm90.cuh), each filled by
// the bulk tensor copy engine (tma_sm90.cuh: one thread, no copy instructions per thread) and
// completing on the buffer's mbarrier. Per block, a warpgroup waits for the block's barrier,
// issues its product, waits for it, releases the buffer and then max-pools the scores and
// offers the row maxima to the top-K lists. The warpgroup that releases a buffer last (a
// counter per buffer) refills it with the block three ahead. No barrier of the whole CTA keeps
// the warpgroups in step: each runs up to two blocks ahead of the slowest, so the max-pooling
// (CUDA cores) of one overlaps the products (tensor cores) of the others, four warps per
// scheduler hiding each other's latencies. The lower tile's warpgroups also score the upper
// tile's own block, all of whose keys lie in their future: masked, it changes nothing.
//
// Short sequences give fewer CTAs than the GPU holds, and the CTA of the last tiles walks all
// the blocks while the first ones walk a few. There the walk is cut into parts
// (SelectParts, select_parts()): part q of a walk runs as a CTA of its own and writes its rows'
// lists to the workspace; the part that finishes last (a counter per walk) merges the others'
// lists into its own and writes the indices. The best K of the union are the best K of the
// row whichever part comes last, so the indices equal those of whole walks.
//
// With T = __nv_fp8_e4m3 (SelectPrecision::kFloat8E4M3, Dp = 128) the kernel reads the FP8
// copies of q_proxy and k_proxy (quantize.cuh) and the keys' scales: the rows are moved as
// 16-bit pairs of bytes through the same copies, shared layouts and fragments (a 128-byte row,
// one SW128 panel), the products are m64n128k32 e4m3 wgmma, and each score is multiplied by
// its key's scale before the pooling. The query's scale is left out: one positive factor per
// row does not change its ranking.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/tma_sm90.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/host/impl.h"
#include "cuda/select/select_tile.cuh"
#include "cuda/select/sm90/select_sm90.h"

namespace flash_msa::cuda::sm90::block_select {

using portable::kBlockKeys;
using portable::kSelectBlockM;

inline constexpr int kTiles = 2;                      // query tiles per CTA
inline constexpr int kRows = kTiles * kSelectBlockM;  // rows per CTA
inline constexpr int kWarpgroups = 4;                 // an m64 row tile each
inline constexpr int kThreads = 128 * kWarpgroups;
inline constexpr int kStages = 3;  // key-block buffers

// The portable kernel's parameters, the tensor map of their kp view (panel_map: 64 16-bit
// columns by 128 keys a box) and the parts of the cut walks.
struct SelectParams {
  portable::SelectKernelParams p;
  CUtensorMap keys;
  SelectParts parts;
};

// The operand type T (bf16, fp16 or FP8 E4M3) and the 16-bit type its rows move as.
template <class T>
struct Operand {
  static constexpr bool kFp8 = std::is_same_v<T, __nv_fp8_e4m3>;
  using Storage = std::conditional_t<kFp8, __nv_bfloat16, T>;  // FP8: pairs, never converted
};

// Dynamic shared memory: 1024 bytes of slack to align the start, the ring of key blocks
// ([128, kCols] SW128 panels of 16-bit columns each, kCols = Dp * sizeof(T) / 2), with FP8 the
// keys' scales ([kStages][128] float), then a region that first holds the CTA's query rows (the
// portable kernel's tile layout, one tile after the other, read once into registers) and then
// the per-row top-K lists (entries [K][256] of {score bits, block}, fill counts [256] int32):
// 226 KiB at Dp = 128 and K = 64 (bf16, fp16), 183 KiB with FP8.
template <int kCols, bool kFp8>
struct SharedMemory {
  static constexpr int kStageBytes = kBlockKeys * kCols * 2;
  static constexpr int kScales = kStages * kStageBytes;  // offset of the key scales
  static constexpr int kRegion = kScales + (kFp8 ? kStages * kBlockKeys * 4 : 0);
  static constexpr int kQueryBytes = kRows * kCols * 2;
  static constexpr int fills_offset(int top_k) { return top_k * kRows * 8; }
  static constexpr int bytes(int top_k) {
    const int lists = fills_offset(top_k) + kRows * 4;
    return 1024 + kRegion + (lists > kQueryBytes ? lists : kQueryBytes);
  }
};

// Part `part`'s lists of the rows [lo, hi) of tile `w` (columns of a [K][kRows] array and
// their fills, complete in shared memory) into `parts`, all kThreads threads.
__device__ __forceinline__ void write_part(const portable::SelectKernelParams& p,
                                           const SelectParts& parts, int part,
                                           const portable::SelectWork& w, const int2* entries,
                                           const int32_t* fills) {
  const int k = p.shape.top_k;
  for (int x = threadIdx.x; x < (w.hi - w.lo) * k; x += kThreads) {
    const int row = w.lo + x / k, slot = x % k;
    const int64_t r =
        p.shape.query_row(int64_t(w.b) * p.shape.proxy_heads + w.h, w.m0 + row) * parts.count +
        part;
    if (slot == 0) parts.fills[r] = fills[row];
    if (slot < fills[row]) parts.entries[r * k + slot] = entries[slot * kRows + row];
  }
}

template <class T, int kDp>
__global__ void __launch_bounds__(kThreads, 1)
    select_kernel(const __grid_constant__ SelectParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const portable::SelectKernelParams& p = params.p;
  constexpr bool kFp8 = Operand<T>::kFp8;
  static_assert(!kFp8 || kDp == 128, "FP8 select: Dp = 128");
  using Storage = typename Operand<T>::Storage;
  constexpr int kCols = kDp * int(sizeof(T)) / 2;  // 16-bit columns per row
  using Smem = SharedMemory<kCols, kFp8>;
  using Tile = portable::SelectTile<kCols>;
  extern __shared__ unsigned char smem_raw[];
  __shared__ BufferRing<kStages, kWarpgroups> ring;  // the key blocks
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* region = smem + Smem::kRegion;
  Storage* qrows = reinterpret_cast<Storage*>(region);
  int2* entries = reinterpret_cast<int2*>(region);
  int32_t* fills = reinterpret_cast<int32_t*>(region + Smem::fills_offset(p.shape.top_k));

  // The CTA's tiles t_lo = t_hi - 1 (below the queries, or -1, at the bottom end: no rows
  // then) and t_hi; this warpgroup's tile and its row tile (rows 64 mt .. 64 mt + 63). CTAs go
  // by tile pair, then part, then (b, h).
  const int parts = params.parts.count;
  const unsigned heads = unsigned(p.shape.batch * p.shape.proxy_heads);
  const int part = int(blockIdx.x / heads) % parts;
  const unsigned walk_id = blockIdx.x / heads / unsigned(parts) * heads + blockIdx.x % heads;
  const portable::SelectWork upper = portable::select_work<kTiles>(p, walk_id);
  const int b = upper.b, t_hi = upper.tile;
  const int wg = warpgroup_index(), tw = wg / 2, mt = wg % 2;
  const portable::SelectWork mine = portable::tile_work(p, b, upper.h, t_hi - 1 + tw);
  // Rows in units of Storage: strides of FP8 views (bytes) halve.
  const Storage* qp = reinterpret_cast<const Storage*>(static_cast<const T*>(p.qp.data) +
                                                       b * p.qp.stride_b + upper.h * p.qp.stride_h);
  const int hk = upper.h / p.shape.proxy_group;
  const int64_t q_stride = p.qp.stride_s * int64_t(sizeof(T)) / 2;
  // FP8: the keys' scales of this batch row and key head, [NB * 128].
  const float* k_scales =
      kFp8 ? p.key_scales + (int64_t(b) * (p.shape.proxy_heads / p.shape.proxy_group) + hk) *
                                p.shape.num_blocks * kBlockKeys
           : nullptr;
  const int m0 = (t_hi - 1) * kSelectBlockM;  // position of the CTA's row 0
  const int n_first = portable::doc_start(p, b, max(m0, 0)) / kBlockKeys;
  const int lo_last = portable::doc_start(p, b, upper.m0 + upper.hi - 1);
  // The walk's key blocks n_first .. t_hi; this part's are n_part + j, j < blocks.
  const int walk = t_hi - n_first + 1, part_blocks = (walk + parts - 1) / parts;
  const int n_part = n_first + part * part_blocks;
  const int blocks = max(min(part_blocks, t_hi + 1 - n_part), 0);

  // Key block n_part + j into buffer j % kStages (one thread), keys past the sequence
  // zero-filled; with FP8 also the block's key scales.
  auto load_block = [&](int j) {
    const int s = j % kStages, n = n_part + j;
    mbarrier_arrive_expect_tx(ring.bar(j), Smem::kStageBytes + (kFp8 ? kBlockKeys * 4 : 0));
#pragma unroll
    for (int panel = 0; panel < kCols / 64; ++panel)
      tma_load_panel(smem + s * Smem::kStageBytes + panel * kBlockKeys * 128, params.keys,
                     64 * panel, n * kBlockKeys, hk, b, ring.bar(j));
    if constexpr (kFp8)
      bulk_load(smem + Smem::kScales + s * kBlockKeys * 4, k_scales + n * kBlockKeys,
                kBlockKeys * 4, ring.bar(j));
  };
  if (threadIdx.x == 0) {
    ring.init();
    for (int j = 0; j < kStages && j < blocks; ++j) load_block(j);
  }
  // The query rows of both tiles (zero where no query), every thread taking part in each copy.
#pragma unroll
  for (int w = 0; w < kTiles; ++w) {
    const portable::SelectWork tw = portable::tile_work(p, b, upper.h, t_hi - 1 + w);
    const int first = tw.hi > tw.lo ? p.shape.query_at(tw.m0 + tw.lo) : 0;
    portable::load_tile<Storage, kCols, kThreads>(
        qrows + w * kSelectBlockM * kCols, qp + int64_t(first) * q_stride, q_stride, tw.lo, tw.hi);
  }
  cp_async_commit();

  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  // This thread's accumulator rows: 64 mt + 16 warp + lane / 4 + 8 h (h = 0, 1) of the
  // warpgroup's tile; their positions and first visible keys (document starts).
  int row_i[2], row_lo[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_i[h] = mine.m0 + 64 * mt + 16 * warp + lane / 4 + 8 * h;
    row_lo[h] = portable::doc_start(p, b, min(max(row_i[h], 0), p.shape.seqlen - 1));
  }
  // Lane 4 r + h (h = 0, 1) owns the list of row h; the other lanes, and rows that are no
  // query, never insert.
  const int my_h = lane % 2;
  const int my_row = 64 * mt + 16 * warp + lane / 4 + 8 * my_h;  // of the warpgroup's tile
  const bool owner = lane % 4 < 2;
  portable::TopKList<kRows> list{entries + kSelectBlockM * tw + my_row, p.shape.top_k};
  if (!owner || my_row < mine.lo || my_row >= mine.hi) list.thr = INFINITY;

  cp_async_wait<0>();
  __syncthreads();  // the query rows are in place; the barriers are set up
  // A fragments of this warp's 16 rows, as for mma.m16n8k16 (FP8: the same bytes are those of
  // mma.m16n8k32).
  uint32_t qa[kCols / 16][4];
#pragma unroll
  for (int kk = 0; kk < kCols / 16; ++kk)
    ldmatrix_x4(qa[kk], qrows + Tile::offset(kSelectBlockM * tw + 64 * mt + 16 * warp + (lane & 15),
                                             kk * 2 + (lane >> 4)));
  __syncthreads();  // the top-K lists overwrite the query rows

  const uint64_t ring_desc = sw128_desc(smem_addr(smem), 16, 1024);
  // S = Qp Kp^T of the row tile over the block in buffer `keys`, one commit group; k-step kk
  // takes bytes 32 kk .. 32 kk + 31 of each row.
  auto issue = [&](float(&acc)[64], const uint32_t(&a)[kCols / 16][4], uint64_t keys) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kCols / 16; ++kk) {
      const uint64_t desc = desc_add(keys, (kk / 4) * kBlockKeys * 128 + (kk % 4) * 32);
      if constexpr (kFp8)
        wgmma_m64n128k32_rs_e4m3(acc, a[kk], desc, kk > 0);
      else
        wgmma_m64n128k16_rs<T>(acc, a[kk], desc, kk > 0);
    }
    wgmma_commit();
  };
  // FP8: the scores of the block in buffer s times their keys' scales (column 8 t + 2 (lane %
  // 4) + e % 2 of entry 4 t + e).
  auto apply_scales = [&](float(&acc)[64], int s) {
    const float* scale = reinterpret_cast<const float*>(smem + Smem::kScales) + s * kBlockKeys +
                         2 * (lane % 4);
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const float2 s2 = *reinterpret_cast<const float2*>(scale + 8 * t);
      acc[4 * t] *= s2.x;
      acc[4 * t + 1] *= s2.y;
      acc[4 * t + 2] *= s2.x;
      acc[4 * t + 3] *= s2.y;
    }
  };
  // Block n's row maxima (masked where a row sees only part of the block: from the own block
  // on, and blocks cut by a document start), scaled (proxy_scale > 0 and rounding is monotone:
  // the maximum of the scaled scores bit for bit), offered to the rows' lists; the own block
  // always enters.
  auto pool = [&](float(&acc)[64], int n) {
    const int key0 = n * kBlockKeys;
    if (n >= mine.tile || key0 < lo_last) {
      int lo[2], hi[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        lo[h] = row_lo[h] - key0 - 2 * (lane % 4);
        hi[h] = row_i[h] - key0 - 2 * (lane % 4);
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
    float m = p.shape.proxy_scale * (my_h == 0 ? mx[0] : mx[1]);
    if (n == mine.tile) m = INFINITY;
    if (m > list.thr) list.insert(m, n);
  };

  for (int j = 0; j < blocks; ++j) {
    const int s = j % kStages;
    ring.wait(j);  // block n_first + j is in buffer s
    float acc[64];
    issue(acc, qa, desc_add(ring_desc, s * Smem::kStageBytes));
    wgmma_wait<0>();
    fence_operands(acc);
    if constexpr (kFp8) {
      apply_scales(acc, s);
      warpgroup_sync(wg);
    }
    // Thread 0 of the warpgroup, once every thread of it is done with the buffer (the
    // product's reads are complete; with FP8, the scales are read).
    if (threadIdx.x % 128 == 0 && ring.release(j) && j + kStages < blocks) load_block(j + kStages);
    pool(acc, n_part + j);
  }

  const bool row_is_query = owner && my_row >= mine.lo && my_row < mine.hi;
  if (owner) fills[kSelectBlockM * tw + my_row] = list.fill;
  __syncthreads();
  if (parts > 1) {
    // This part's lists to the workspace; the walk's last part to finish merges the others'.
    __shared__ uint32_t last;
#pragma unroll
    for (int w = 0; w < kTiles; ++w)
      write_part(p, params.parts, part, portable::tile_work(p, b, upper.h, t_hi - 1 + w),
                 entries + kSelectBlockM * w, fills + kSelectBlockM * w);
    __threadfence();  // the lists before the count, for the last part's reads
    __syncthreads();
    if (threadIdx.x == 0)
      last = atomicAdd(&params.parts.done[walk_id], 1u) == uint32_t(parts - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();  // the count before the other parts' lists
    if (row_is_query) {
      const int64_t r =
          p.shape.query_row(int64_t(b) * p.shape.proxy_heads + upper.h, mine.m0 + my_row) * parts;
      for (int q = 0; q < parts; ++q) {
        if (q == part) continue;
        const int2* in = params.parts.entries + (r + q) * p.shape.top_k;
        const int n = __ldcg(params.parts.fills + r + q);
        // Eight entries' loads in flight at a time, then their merges.
        for (int e0 = 0; e0 < n; e0 += 8) {
          int2 c[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) c[u] = e0 + u < n ? __ldcg(in + e0 + u) : int2{};
#pragma unroll
          for (int u = 0; u < 8; ++u)
            if (e0 + u < n) list.merge(__int_as_float(c[u].x), c[u].y);
        }
      }
      fills[kSelectBlockM * tw + my_row] = list.fill;
    }
    __syncthreads();
  }
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
void launch_select(const portable::SelectKernelParams& params, const SelectParts& parts,
                   cudaStream_t stream) {
  using namespace block_select;
  constexpr int kCols = kDp * int(sizeof(T)) / 2;
  using Smem = SharedMemory<kCols, Operand<T>::kFp8>;
  const KernelShape& sh = params.shape;
  const SelectParams launch{
      .p = params,
      .keys = panel_map("kp", params.kp, int(sizeof(T)), sh.batch,
                        sh.proxy_heads / sh.proxy_group, sh.seqlen, kCols),
      .parts = parts};
  const unsigned walks = portable::select_grid<kTiles>(params);
  if (parts.count > 1)
    FLASH_MSA_CUDA_CHECK(cudaMemsetAsync(parts.done, 0, walks * sizeof(uint32_t), stream));
  launch_large_smem(select_kernel<T, kDp>, walks * parts.count, kThreads, Smem::bytes(sh.top_k),
                    launch, stream);
}

}  // namespace flash_msa::cuda::sm90
