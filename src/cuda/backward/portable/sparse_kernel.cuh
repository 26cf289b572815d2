// Portable (mma.sync) sparse main-attention backward of MSA (SPEC section 4), key-block-outer
// like the forward (forward/portable/sparse_kernel.cuh): one CTA per work item of the schedule
// keeps block n's K and V in shared memory and dK, dV of the block in registers, and streams 64-row
// tiles of floor(64 / G) tokens x G heads (Q and dO double-buffered):
//   S = Q K^T, dP = dO V^T                     (8 warps as 4 x 2: 16 rows x 64 keys each)
//   P = exp2(S scale log2e - lse log2e), dS = P (dP - Delta)   (to shared memory, in the dtype)
//   dV += P^T dO, dK += dS^T Q                 (8 warps as 4 x 2: 32 keys x D/2 each)
//   dQ_n = dS K                                (16 rows x D/2 each), stored per edge in the dtype
// and, when the proxy gradients or the KL value need it, the teacher of each token,
// t = mean over the G heads of P (SPEC section 3), stored per edge for the proxy kernel.
// Nothing is accumulated across CTAs here: dQ is summed over each token's slots and dK, dV over
// a block's items by fixed-order reductions (passes/reduce.cu), so the gradients are bitwise
// reproducible. Scales are applied there too.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/backward/portable/sparse_portable.h"
#include "cuda/common/instantiate.h"
#include "cuda/common/tile_sm80.cuh"
#include "cuda/host/check.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::portable::sparse_backward {

inline constexpr int kThreads = 256;  // 8 warps
inline constexpr int kRows = 64;      // rows of a query tile
inline constexpr int kKeys = 128;     // keys of a block
inline constexpr float kLog2e = 1.4426950408889634f;

template <int kD>
struct SharedMemory {  // element offsets: K, V, Q[2], dO[2], P, dS
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKeys * kD;
  static constexpr int kQ = kV + kKeys * kD;
  static constexpr int kDout = kQ + 2 * kRows * kD;
  static constexpr int kP = kDout + 2 * kRows * kD;
  static constexpr int kDs = kP + kRows * kKeys;
  static constexpr int kBytes = (kDs + kRows * kKeys) * 2;
};

// Stores the pair of values of columns col, col + 1 (col even) of row r of a [rows, 128] tile.
template <class T>
__device__ __forceinline__ void store_pair(T* tile, int r, int col, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(tile + tile_offset<kKeys>(r, col & ~7) + (col & 7)) =
      Elem<T>::pack(lo, hi);
}

template <class T, int kD, bool kTeacherOnly>
__global__ void __launch_bounds__(kThreads, 1) backward_kernel(const SparseBackwardParams p) {
  using Smem = SharedMemory<kD>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* s_k = smem + Smem::kK;
  T* s_v = smem + Smem::kV;
  T* s_p = smem + Smem::kP;
  T* s_ds = smem + Smem::kDs;
  constexpr int kHalfD = kD / 2;

  schedule::Item item;
  if (!schedule::find_item(p.items, p.shape, blockIdx.x, item)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = item.b, head0 = item.head0, key0 = item.key0;
  const int kv = head0 / p.shape.kv_group;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.stride_b + kv * p.k.stride_h;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.stride_b + kv * p.v.stride_h;
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.stride_b + head0 * p.q.stride_h;
  const T* dout =
      static_cast<const T*>(p.dout.data) + b * p.dout.stride_b + head0 * p.dout.stride_h;
  const uint64_t* entries = p.index.entries;
  const int32_t* doc_start = p.index.doc_start + int64_t(b) * p.shape.seqlen;
  // lse / delta of head0 at position 0 (query_row of head0 + g at position t: + g Sq + t).
  const int64_t stats = p.shape.query_row(int64_t(b) * p.shape.heads + head0, 0);

  copy_rows_async<kKeys, kD, kThreads>(
      s_k,
      [&](int r) { return key0 + r < p.shape.seqlen ? k + (key0 + r) * p.k.stride_s : nullptr; },
      k);
  if (!kTeacherOnly)
    copy_rows_async<kKeys, kD, kThreads>(
        s_v,
        [&](int r) { return key0 + r < p.shape.seqlen ? v + (key0 + r) * p.v.stride_s : nullptr; },
        v);
  cp_async_commit();

  const int tile_tokens = kRows / p.shape.group;
  auto load_tile = [&](int e0, int buf) {
    auto token_of = [&](int r) {  // the token of tile row r, or -1 past the item
      const int t = r / p.shape.group;
      return t < tile_tokens && e0 + t < item.end ? schedule::entry_token(entries[e0 + t]) : -1;
    };
    copy_rows_async<kRows, kD, kThreads>(
        smem + Smem::kQ + buf * kRows * kD,
        [&](int r) -> const T* {
          const int token = token_of(r);
          return token < 0 ? nullptr
                           : q + (r % p.shape.group) * p.q.stride_h +
                                 p.shape.query_at(token) * p.q.stride_s;
        },
        q);
    if (!kTeacherOnly)
      copy_rows_async<kRows, kD, kThreads>(
          smem + Smem::kDout + buf * kRows * kD,
          [&](int r) -> const T* {
            const int token = token_of(r);
            return token < 0
                       ? nullptr
                       : dout + (r % p.shape.group) * p.dout.stride_h +
                             p.shape.query_at(token) * p.dout.stride_s;
          },
          dout);
    cp_async_commit();
  };
  load_tile(item.begin, 0);

  // dK, dV of keys 32 (warp / 2) .., columns D/2 (warp % 2) ..
  float dk[2][kHalfD / 8][4], dv[2][kHalfD / 8][4];
  if (!kTeacherOnly) {
    zero(dk);
    zero(dv);
  }
  const int wm = warp / 2, wn = warp % 2;

  int buf = 0;
  for (int e0 = item.begin; e0 < item.end; e0 += tile_tokens, buf ^= 1) {
    cp_async_wait<0>();
    __syncthreads();
    if (e0 + tile_tokens < item.end) load_tile(e0 + tile_tokens, buf ^ 1);
    const T* s_q = smem + Smem::kQ + buf * kRows * kD;
    const T* s_dout = smem + Smem::kDout + buf * kRows * kD;
    const int live_tokens = min(tile_tokens, item.end - e0);
    const int live_rows = live_tokens * p.shape.group;

    float s[1][8][4];
    zero(s);
    gemm<T, GemmLayout::kNT, 1, 8, kD, kD, kD>(s, s_q, 16 * wm, s_k, 64 * wn, lane);
    float dp[1][8][4];
    if (!kTeacherOnly) {
      zero(dp);
      gemm<T, GemmLayout::kNT, 1, 8, kD, kD, kD>(dp, s_dout, 16 * wm, s_v, 64 * wn, lane);
    }
    // Rows 16 wm + 8 h + lane / 4 of S, dP (read after the products: fewer live registers).
    int query[2], first[2];
    float lse2[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * wm + 8 * h + lane / 4;
      query[h] = -1;  // no visible key
      first[h] = INT_MAX;
      lse2[h] = 0.f;
      delta[h] = 0.f;
      if (r < live_rows) {
        query[h] = schedule::entry_token(entries[e0 + r / p.shape.group]);
        first[h] = __ldg(doc_start + query[h]);
        const int64_t at = stats + int64_t(r % p.shape.group) * p.shape.queries + query[h];
        lse2[h] = __ldg(p.lse + at) * kLog2e;
        if (!kTeacherOnly) delta[h] = __ldg(p.delta + at);
      }
    }

#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 64 * wn + nt * 8 + 2 * (lane % 4);
        float pr[2], ds[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + col + e;
          const bool visible = key <= query[h] && key >= first[h];
          pr[e] = visible ? exp2f(s[0][nt][2 * h + e] * p.shape.scale_log2 - lse2[h]) : 0.f;
          ds[e] = kTeacherOnly ? 0.f : pr[e] * (dp[0][nt][2 * h + e] - delta[h]);
        }
        const int r = 16 * wm + 8 * h + lane / 4;
        store_pair(s_p, r, col, pr[0], pr[1]);
        if (!kTeacherOnly) store_pair(s_ds, r, col, ds[0], ds[1]);
      }
    __syncthreads();

    if (p.teacher) {
      const float inv_group = 1.f / p.shape.group;
      for (int x = threadIdx.x; x < live_tokens * kKeys; x += kThreads) {
        const int t = x / kKeys, col = x % kKeys;
        float sum = 0.f;
        for (int g = 0; g < p.shape.group; ++g)
          sum += Elem<T>::to_float(
              s_p[tile_offset<kKeys>(t * p.shape.group + g, col & ~7) + (col & 7)]);
        const uint64_t entry = entries[e0 + t];
        const int64_t ce = schedule::chunk_edge(item.bp, p.chunk, p.shape.top_k, entry);
        p.teacher[ce * kKeys + col] = sum * inv_group;
      }
    }
    if constexpr (kTeacherOnly) continue;

    gemm<T, GemmLayout::kTN, 2, kHalfD / 8, kRows, kKeys, kD>(dv, s_p, 32 * wm, s_dout, kHalfD * wn,
                                                              lane);
    gemm<T, GemmLayout::kTN, 2, kHalfD / 8, kRows, kKeys, kD>(dk, s_ds, 32 * wm, s_q, kHalfD * wn,
                                                              lane);
    float dq[1][kHalfD / 8][4];
    zero(dq);
    gemm<T, GemmLayout::kNN, 1, kHalfD / 8, kKeys, kKeys, kD>(dq, s_ds, 16 * wm, s_k, kHalfD * wn,
                                                              lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * wm + 8 * h + lane / 4;
      if (r >= live_rows) continue;
      const uint64_t entry = entries[e0 + r / p.shape.group];
      const int64_t ce = schedule::chunk_edge(item.bp, p.chunk, p.shape.top_k, entry);
      uint32_t words[kHalfD / 8];  // column tiles kHalfD / 8 wn .. (fragment order)
#pragma unroll
      for (int nt = 0; nt < kHalfD / 8; ++nt)
        words[nt] = Elem<T>::pack(dq[0][nt][2 * h], dq[0][nt][2 * h + 1]);
      store_fragment_row<kHalfD / 8, 1>(
          static_cast<T*>(p.dq_part) + (ce * p.shape.group + r % p.shape.group) * kD, lane % 4,
          (kHalfD / 8) * wn, words);
    }
  }

  if constexpr (!kTeacherOnly) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = 32 * wm + 16 * mt + 8 * h + lane / 4;
        const int64_t at = (int64_t(blockIdx.x) * kKeys + key) * kD + kHalfD * wn + 2 * (lane % 4);
#pragma unroll
        for (int nt = 0; nt < kHalfD / 8; ++nt) {
          *reinterpret_cast<float2*>(p.dk_part + at + nt * 8) =
              make_float2(dk[mt][nt][2 * h], dk[mt][nt][2 * h + 1]);
          *reinterpret_cast<float2*>(p.dv_part + at + nt * 8) =
              make_float2(dv[mt][nt][2 * h], dv[mt][nt][2 * h + 1]);
        }
      }
  }
}

}  // namespace flash_msa::cuda::portable::sparse_backward

namespace flash_msa::cuda::portable {

template <class T, int kD, bool kTeacherOnly>
void launch_sparse_backward(const SparseBackwardParams& params, cudaStream_t stream) {
  constexpr int kBytes = sparse_backward::SharedMemory<kD>::kBytes;
  const auto kernel = sparse_backward::backward_kernel<T, kD, kTeacherOnly>;
  FLASH_MSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<static_cast<unsigned>(params.items.max_items), sparse_backward::kThreads, kBytes,
           stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::portable

// One explicit instantiation for element type T (FLASH_MSA_INSTANTIATE, common/instantiate.h).
#define FLASH_MSA_SPARSE_BACKWARD_DIM(T, D) \
  template void launch_sparse_backward<T, D, false>(const SparseBackwardParams&, cudaStream_t);
