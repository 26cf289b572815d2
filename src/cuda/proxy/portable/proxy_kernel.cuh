// Portable (mma.sync) proxy branch over the selected blocks, key-block-outer: one CTA per work
// item keeps block n's proxy keys Kp in shared memory and streams 64-token tiles of proxy
// queries (one row per token: the proxy head is shared by the group), double-buffered.
//   Sp = Qp Kp^T                      (8 warps as 4 x 2: 16 rows x 64 keys each)
// then, by mode,
//   kLse:  the log-sum-exp of the row's visible scores in the block (log2 domain), per edge;
//   kKl:   sum over the block of t (log t - log pp), pp = exp(Sp - lse_proxy), per edge;
//   kGrad: g = w (pp - t) / (B Hp S) in the dtype in shared memory, dQp_n = g Kp per edge
//          (16 rows x Dp/2 per warp) and dKp += g^T Qp in registers (32 keys x Dp/2), stored
//          per item; where kl_part is given, also the kKl terms (the backward's KL value).
// t is the teacher per edge from the main backward kernel; it comes into shared memory with the
// tile's Qp (and lse_proxy), the tokens and edges of the item from schedule::ItemRows, so that
// no global load waits inside a tile. Row quantities are combined across the two warps of a row
// through shared memory. As in the main kernels nothing is accumulated
// across CTAs, and the scale factors are applied by the reductions.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/instantiate.h"
#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/host/check.h"
#include "cuda/proxy/portable/proxy_portable.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::portable::proxy {

inline constexpr int kThreads = 256;  // 8 warps
inline constexpr int kRows = 64;      // tokens of a tile
inline constexpr int kKeys = 128;     // keys of a block
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

inline constexpr int kTeacherStride = kKeys + 8;  // floats per teacher row in shared memory

// Element offsets of Kp, Qp[2], g; then byte offsets of the fp32 row exchange [2][2][64] and,
// with kWithTeacher, the tiles' lse_proxy [2][64] and teacher rows [2][64][kTeacherStride] (padded
// so that a warp's float2 reads of 8 rows fall in distinct banks as far as they can).
template <int kDp, bool kWithTeacher>
struct SharedMemory {
  static constexpr int kKp = 0;
  static constexpr int kQp = kKp + kKeys * kDp;
  static constexpr int kG = kQp + 2 * kRows * kDp;
  static constexpr int kExchange = (kG + kRows * kKeys) * 2;
  static constexpr int kLse = kExchange + 2 * 2 * kRows * 4;
  static constexpr int kTeacher = kLse + 2 * kRows * 4;
  static constexpr int kBytes = kTeacher + (kWithTeacher ? 2 * kRows * kTeacherStride * 4 : 0);
};

template <class T, int kDp, ProxyMode kMode>
__global__ void __launch_bounds__(kThreads, 1) proxy_kernel(const ProxyParams p) {
  constexpr bool kGrad = kMode == ProxyMode::kGrad;
  constexpr bool kTeacher = kMode != ProxyMode::kLse;
  using Smem = SharedMemory<kDp, kTeacher>;
  constexpr int kHalfDp = kDp / 2;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ schedule::ItemRows rows;
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* s_kp = smem + Smem::kKp;
  T* s_g = smem + Smem::kG;
  float(*exchange)[2][kRows] = reinterpret_cast<float(*)[2][kRows]>(smem_raw + Smem::kExchange);
  float(*s_lse)[kRows] = reinterpret_cast<float(*)[kRows]>(smem_raw + Smem::kLse);
  float* s_teacher = reinterpret_cast<float*>(smem_raw + Smem::kTeacher);

  schedule::Item item;
  if (!schedule::find_item(p.items, p.shape, blockIdx.x, item)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 2, wn = warp % 2;
  const int b = item.b, ph = item.ph, key0 = item.key0;
  const T* kp = static_cast<const T*>(p.kp.data) + b * p.kp.stride_b +
                (ph / p.shape.proxy_group) * p.kp.stride_h;
  const T* qp = static_cast<const T*>(p.qp.data) + b * p.qp.stride_b + ph * p.qp.stride_h;
  const float coef = kGrad && p.kl_grad ? __ldg(p.kl_grad) * p.shape.inv_rows : 0.f;
  // kGrad with kl_part: the KL value's per-edge terms too, from the same teacher and scores.
  const bool kl_value = kMode == ProxyMode::kKl || (kGrad && p.kl_part != nullptr);

  copy_rows_async<kKeys, kDp, kThreads>(
      s_kp,
      [&](int r) { return key0 + r < p.shape.seqlen ? kp + (key0 + r) * p.kp.stride_s : nullptr; },
      kp);
  cp_async_commit();
  schedule::load_item_rows<kThreads>(rows, item, p, threadIdx.x);
  __syncthreads();  // the item's rows are in place
  const int item_rows = item.end - item.begin;
  // Qp of the tile at item row t0 into buffer buf, with its rows' lse_proxy and teacher rows
  // (zeros past the item).
  auto load_tile = [&](int t0, int buf) {
    copy_rows_async<kRows, kDp, kThreads>(
        smem + Smem::kQp + buf * kRows * kDp,
        [&](int r) -> const T* {
          return t0 + r < item_rows
                     ? qp + p.shape.query_at(rows.token[t0 + r]) * p.qp.stride_s
                     : nullptr;
        },
        qp);
    if constexpr (kTeacher) {
      if (threadIdx.x < kRows) {
        const int r = threadIdx.x;
        const bool live = t0 + r < item_rows;
        cp_async_4(
            &s_lse[buf][r],
            p.lse_proxy + p.shape.query_row(item.bp, live ? rows.token[t0 + r]
                                                          : p.shape.query_offset),
            live);
      }
#pragma unroll 4
      for (int x = threadIdx.x; x < kRows * kKeys / 4; x += kThreads) {
        const int r = x / (kKeys / 4), c = 4 * (x % (kKeys / 4));
        const bool live = t0 + r < item_rows;
        cp_async_16(s_teacher + (buf * kRows + r) * kTeacherStride + c,
                    p.teacher + (live ? rows.edge[t0 + r] : 0) * kKeys + c, live);
      }
    }
    cp_async_commit();
  };
  load_tile(0, 0);

  float dkp[2][kHalfDp / 8][4];
  if (kGrad) zero(dkp);

  int buf = 0;
  for (int t0 = 0; t0 < item_rows; t0 += kRows, buf ^= 1) {
    cp_async_wait<0>();
    __syncthreads();
    if (t0 + kRows < item_rows) load_tile(t0 + kRows, buf ^ 1);
    const T* s_qp = smem + Smem::kQp + buf * kRows * kDp;
    const int live_rows = min(kRows, item_rows - t0);

    // Rows 16 wm + 8 h + lane / 4 of Sp.
    int query[2], first[2];
    int64_t edge[2];
    float lse2[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * wm + 8 * h + lane / 4;
      query[h] = -1;  // no visible key
      first[h] = INT_MAX;
      edge[h] = 0;
      lse2[h] = 0.f;
      if (r < live_rows) {
        query[h] = rows.token[t0 + r];
        first[h] = rows.first[t0 + r];
        edge[h] = rows.edge[t0 + r];
        if (kTeacher) lse2[h] = s_lse[buf][r] * kLog2e;
      }
    }

    float s[1][8][4];
    zero(s);
    gemm<T, GemmLayout::kNT, 1, 8, kDp, kDp, kDp>(s, s_qp, 16 * wm, s_kp, 64 * wn, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 64 * wn + nt * 8 + 2 * (lane % 4) + (e & 1);
        const bool visible = key <= query[e / 2] && key >= first[e / 2];
        s[0][nt][e] = visible ? s[0][nt][e] * p.shape.proxy_scale_log2 : -INFINITY;
      }

    if constexpr (kMode == ProxyMode::kLse) {
      float m[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[0][nt][2 * h], s[0][nt][2 * h + 1]));
        mx = quad_max(mx);
        if (lane % 4 == 0) exchange[0][wn][16 * wm + 8 * h + lane / 4] = mx;
      }
      __syncthreads();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * wm + 8 * h + lane / 4;
        m[h] = fmaxf(exchange[0][0][r], exchange[0][1][r]);
        const float m_use = m[h] == -INFINITY ? 0.f : m[h];
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          sum += fast_exp2(s[0][nt][2 * h] - m_use) + fast_exp2(s[0][nt][2 * h + 1] - m_use);
        sum = quad_sum(sum);
        if (lane % 4 == 0) exchange[1][wn][r] = sum;
      }
      __syncthreads();
      if (wn == 0 && lane % 4 == 0)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * wm + 8 * h + lane / 4;
          const float sum = exchange[1][0][r] + exchange[1][1][r];
          if (r < live_rows) p.lse_p_part[edge[h]] = sum > 0.f ? m[h] + fast_log2(sum) : -INFINITY;
        }
    } else {
      // The teacher of this lane's two columns per n-tile, for each of its rows.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * wm + 8 * h + lane / 4;
        const float* t_row = s_teacher + (buf * kRows + r) * kTeacherStride;
        float term = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int col = 64 * wn + nt * 8 + 2 * (lane % 4);
          const float2 t = *reinterpret_cast<const float2*>(t_row + col);
          const float tv[2] = {t.x, t.y};
          float g[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = s[0][nt][2 * h + e];
            if (kl_value && !(tv[e] <= 0.f) && x != -INFINITY)
              term += tv[e] * (__logf(tv[e]) - (x - lse2[h]) * kLn2);
            if constexpr (kGrad)
              g[e] = x == -INFINITY ? 0.f : coef * (fast_exp2(x - lse2[h]) - tv[e]);
          }
          if constexpr (kGrad) {
            *reinterpret_cast<uint32_t*>(s_g + tile_offset<kKeys>(r, col & ~7) + (col & 7)) =
                Elem<T>::pack(g[0], g[1]);
          }
        }
        if (kl_value) {
          term = quad_sum(term);
          if (lane % 4 == 0) exchange[1][wn][r] = term;
        }
      }
      __syncthreads();
      if (kl_value && wn == 0 && lane % 4 == 0)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * wm + 8 * h + lane / 4;
          if (r < live_rows) p.kl_part[edge[h]] = exchange[1][0][r] + exchange[1][1][r];
        }
      if constexpr (kGrad) {
        gemm<T, GemmLayout::kTN, 2, kHalfDp / 8, kRows, kKeys, kDp>(dkp, s_g, 32 * wm, s_qp,
                                                                    kHalfDp * wn, lane);
        float dq[1][kHalfDp / 8][4];
        zero(dq);
        gemm<T, GemmLayout::kNN, 1, kHalfDp / 8, kKeys, kKeys, kDp>(dq, s_g, 16 * wm, s_kp,
                                                                    kHalfDp * wn, lane);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * wm + 8 * h + lane / 4;
          if (r >= live_rows) continue;
          uint32_t words[kHalfDp / 4];  // fp32, fragment order (mma_sm80.cuh)
#pragma unroll
          for (int nt = 0; nt < kHalfDp / 8; ++nt) {
            words[2 * nt] = __float_as_uint(dq[0][nt][2 * h]);
            words[2 * nt + 1] = __float_as_uint(dq[0][nt][2 * h + 1]);
          }
          store_fragment_row<kHalfDp / 8, 2>(p.dqp_part + edge[h] * kDp, lane % 4,
                                             (kHalfDp / 8) * wn, words);
        }
      }
    }
  }

  if constexpr (kGrad) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = 32 * wm + 16 * mt + 8 * h + lane / 4;
        const int64_t at =
            (int64_t(blockIdx.x) * kKeys + key) * kDp + kHalfDp * wn + 2 * (lane % 4);
#pragma unroll
        for (int nt = 0; nt < kHalfDp / 8; ++nt)
          *reinterpret_cast<float2*>(p.dkp_part + at + nt * 8) =
              make_float2(dkp[mt][nt][2 * h], dkp[mt][nt][2 * h + 1]);
      }
  }
}

}  // namespace flash_msa::cuda::portable::proxy

namespace flash_msa::cuda::portable {

template <class T, int kDp, ProxyMode kMode>
void launch_proxy(const ProxyParams& params, cudaStream_t stream) {
  constexpr int kBytes = proxy::SharedMemory<kDp, kMode != ProxyMode::kLse>::kBytes;
  const auto kernel = proxy::proxy_kernel<T, kDp, kMode>;
  FLASH_MSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<static_cast<unsigned>(params.items.max_items), proxy::kThreads, kBytes, stream>>>(
      params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::portable

// One explicit instantiation for element type T (FLASH_MSA_INSTANTIATE, common/instantiate.h).
#define FLASH_MSA_PROXY_DIM(T, DP)                                                      \
  template void launch_proxy<T, DP, ProxyMode::kLse>(const ProxyParams&, cudaStream_t); \
  template void launch_proxy<T, DP, ProxyMode::kKl>(const ProxyParams&, cudaStream_t);  \
  template void launch_proxy<T, DP, ProxyMode::kGrad>(const ProxyParams&, cudaStream_t);
