// Portable (mma.sync) sparse main-attention forward of MSA (SPEC section 2), key-block-outer as
// in the MSA paper (sec. 4.2).
//
// Why key-block-outer: all G heads of a proxy group share each token's selection, so a
// query-outer kernel fills only G rows of an MMA tile per token and reloads a block's K and V
// (64 KiB at D = 128) for every token that selected it: about G FLOP per byte, which leaves it
// bound by L2 bandwidth far below the tensor-core rate (42 TFLOP/s measured for the former
// query-outer kernel at S = 32K). Here one CTA takes a work item of the schedule (up to 256
// tokens that selected one key block n of proxy head p), keeps K_n and V_n in shared memory and
// streams 128-row query tiles: floor(128 / G) tokens x G heads (8 x 16 in the paper's shape).
// Every row of every tile is useful work, whatever the selection pattern, and K/V traffic drops
// to one load per item. The price is the merge: each (token, head) gets one partial result per
// selected block, normalised within the block (o_n, lse_n), and passes/merge.cu combines them
// by log-sum-exp in a second pass.
//
// Per tile: 4 warps x 32 rows; the block's 128 keys in four steps of 32 with an online softmax
// in fp32 (exp2 of log2(e)-prescaled scores); P rounded to the input dtype feeds P V from
// registers. Masking (causal inside the own block, documents) runs only in warps whose tile
// rows need it. The query tile is single-buffered: the next tile's copy starts once every warp
// has finished its last Q K^T of the current tile and overlaps the remaining softmax, P V and
// stores (two CTAs per SM hide the rest).
//
// Partial rows are stored in the mma fragment order (mma_sm80.cuh), so each lane writes
// 16-byte vectors; the merge undoes the permutation.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/instantiate.h"
#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/forward/portable/sparse_portable.h"
#include "cuda/host/check.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::portable::sparse_forward {

inline constexpr int kThreads = 128;  // 4 warps x 32 tile rows
inline constexpr int kRows = 128;     // rows of a query tile
inline constexpr int kKeys = 128;     // keys of a block
inline constexpr int kStepKeys = 32;  // keys per online-softmax step

template <int kD>
struct SharedMemory {  // K, V of the block and the query tile
  static constexpr int kBytes = (2 * kKeys + kRows) * kD * 2;
};

template <class T, int kD>
__global__ void __launch_bounds__(kThreads, 2) forward_kernel(const SparseForwardParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);
  T* s_v = s_k + kKeys * kD;
  T* s_q = s_v + kKeys * kD;
  constexpr int kDTiles = kD / 8;

  schedule::Item item;
  if (!schedule::find_item(p.items, p.shape, blockIdx.x, item)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = item.b, head0 = item.head0, key0 = item.key0;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.stride_b +
               (head0 / p.shape.kv_group) * p.k.stride_h;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.stride_b +
               (head0 / p.shape.kv_group) * p.v.stride_h;
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.stride_b + head0 * p.q.stride_h;
  const uint64_t* entries = p.index.entries;
  const int32_t* doc_start = p.index.doc_start + int64_t(b) * p.shape.seqlen;

  copy_rows_async<kKeys, kD, kThreads>(
      s_k,
      [&](int r) { return key0 + r < p.shape.seqlen ? k + (key0 + r) * p.k.stride_s : nullptr; },
      k);
  copy_rows_async<kKeys, kD, kThreads>(
      s_v,
      [&](int r) { return key0 + r < p.shape.seqlen ? v + (key0 + r) * p.v.stride_s : nullptr; },
      v);
  cp_async_commit();

  const int tile_tokens = kRows / p.shape.group;
  auto load_q = [&](int e0) {
    copy_rows_async<kRows, kD, kThreads>(
        s_q,
        [&](int r) -> const T* {
          const int t = r / p.shape.group;
          if (t >= tile_tokens || e0 + t >= item.end) return nullptr;
          const int token = schedule::entry_token(entries[e0 + t]);
          return q + (r % p.shape.group) * p.q.stride_h + p.shape.query_at(token) * p.q.stride_s;
        },
        q);
    cp_async_commit();
  };
  load_q(item.begin);

  for (int e0 = item.begin; e0 < item.end; e0 += tile_tokens) {
    cp_async_wait<0>();
    __syncthreads();
    const int live_rows = min(tile_tokens, item.end - e0) * p.shape.group;
    const bool warp_live = 32 * warp < live_rows;

    // This lane's rows: row(mt, h) = 32 warp + 16 mt + 8 h + lane / 4.
    int query[2][2], first[2][2];
    bool need_mask = false;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 32 * warp + 16 * mt + 8 * h + lane / 4;
        query[mt][h] = INT_MAX;
        first[mt][h] = INT_MIN;
        if (r < live_rows) {
          query[mt][h] = schedule::entry_token(entries[e0 + r / p.shape.group]);
          first[mt][h] = __ldg(doc_start + query[mt][h]);
          need_mask |= query[mt][h] < key0 + kKeys - 1 || first[mt][h] > key0;
        }
      }
    need_mask = __any_sync(0xffffffffu, need_mask);

    float o[2][kDTiles][4];
    zero(o);
    float m[2][2], l[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m[mt][h] = -INFINITY;
        l[mt][h] = 0.f;
      }

#pragma unroll
    for (int step = 0; step < kKeys / kStepKeys; ++step) {
      float s[2][kStepKeys / 8][4];
      zero(s);
      if (warp_live)
        gemm<T, GemmLayout::kNT, 2, kStepKeys / 8, kD, kD, kD>(s, s_q, 32 * warp, s_k,
                                                               step * kStepKeys, lane);
      if (step == kKeys / kStepKeys - 1) {
        __syncthreads();  // every warp is done reading s_q
        if (e0 + tile_tokens < item.end) load_q(e0 + tile_tokens);
      }
      if (!warp_live) continue;

#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < kStepKeys / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[mt][nt][e] * p.shape.scale_log2;
            if (need_mask) {
              const int key = key0 + step * kStepKeys + nt * 8 + 2 * (lane % 4) + (e & 1);
              if (key > query[mt][e / 2] || key < first[mt][e / 2]) x = -INFINITY;
            }
            s[mt][nt][e] = x;
          }

#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kStepKeys / 8; ++nt)
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          const float m_new = fmaxf(m[mt][h], quad_max(mx));
          // A row with no visible key yet keeps m = -inf; subtract 0 then, not -inf.
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = exp2f(m[mt][h] - m_use);
          m[mt][h] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < kStepKeys / 8; ++nt) {
            s[mt][nt][2 * h] = exp2f(s[mt][nt][2 * h] - m_use);
            s[mt][nt][2 * h + 1] = exp2f(s[mt][nt][2 * h + 1] - m_use);
            sum += s[mt][nt][2 * h] + s[mt][nt][2 * h + 1];
          }
          l[mt][h] = l[mt][h] * alpha + sum;  // lane-partial; the quad sum comes at the end
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            o[mt][dt][2 * h] *= alpha;
            o[mt][dt][2 * h + 1] *= alpha;
          }
        }

      // P in the dtype as the A fragments of the P V product (half the registers of s).
      uint32_t a[kStepKeys / 16][2][4];
#pragma unroll
      for (int j = 0; j < kStepKeys / 16; ++j)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) acc_to_a<T>(a[j][mt], s[mt][2 * j], s[mt][2 * j + 1]);
#pragma unroll
      for (int j = 0; j < kStepKeys / 16; ++j)
#pragma unroll
        for (int dn = 0; dn < kD / 16; ++dn) {
          uint32_t bv[2][2];
          load_b2_trans<kD>(bv, s_v, dn * 16, step * kStepKeys + j * 16, lane);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_16x8x16<T>(o[mt][2 * dn], a[j][mt], bv[0]);
            mma_16x8x16<T>(o[mt][2 * dn + 1], a[j][mt], bv[1]);
          }
        }
    }
    if (!warp_live) continue;

#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l_row = quad_sum(l[mt][h]);
        const int r = 32 * warp + 16 * mt + 8 * h + lane / 4;
        if (r >= live_rows) continue;
        const uint64_t entry = entries[e0 + r / p.shape.group];
        const int64_t ce = schedule::chunk_edge(item.bp, p.chunk, p.shape.top_k, entry);
        const int64_t row = ce * p.shape.group + r % p.shape.group;
        const float inv = l_row > 0.f ? 1.f / l_row : 0.f;
        uint32_t packed[kDTiles];
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
          packed[dt] = Elem<T>::pack(o[mt][dt][2 * h] * inv, o[mt][dt][2 * h + 1] * inv);
        store_fragment_row<kDTiles, 1>(static_cast<T*>(p.o_part) + row * kD, lane % 4, 0, packed);
        if (lane % 4 == 0) p.lse_part[row] = l_row > 0.f ? m[mt][h] + __log2f(l_row) : -INFINITY;
      }
  }
}

}  // namespace flash_msa::cuda::portable::sparse_forward

namespace flash_msa::cuda::portable {

template <class T, int kD>
void launch_sparse_forward(const SparseForwardParams& params, cudaStream_t stream) {
  constexpr int kBytes = sparse_forward::SharedMemory<kD>::kBytes;
  const auto kernel = sparse_forward::forward_kernel<T, kD>;
  FLASH_MSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<static_cast<unsigned>(params.items.max_items), sparse_forward::kThreads, kBytes,
           stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::portable

// One explicit instantiation for element type T (FLASH_MSA_INSTANTIATE, common/instantiate.h).
#define FLASH_MSA_SPARSE_FORWARD_DIM(T, D) \
  template void launch_sparse_forward<T, D>(const SparseForwardParams&, cudaStream_t);
