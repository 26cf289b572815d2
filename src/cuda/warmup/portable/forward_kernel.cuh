// Portable (mma.sync) dense main attention forward of MSA: warmup mode (SPEC sections 2, 3, 5
// with T(p, i) = every visible key). The sparse mode runs key-block-outer
// (forward/portable/sparse_kernel.cuh).
//
// Design: query-outer. All G = H / Hp main heads of a proxy group attend the same keys, so one
// warp owns one (batch, proxy head, token): its 16-row MMA tile holds the G heads (rows G..15
// zero and inactive when G < 16) and it walks every block from the token's document start to its
// own block in 32-key tiles with an online softmax in fp32 (exp2 of log2(e)-prescaled scores).
// Each warp has its own double-buffered K/V/Kp tiles in shared memory (cp.async, zero-filled
// past the causal horizon), so warps never wait for each other.
//
// Proxy log-sum-exp: the proxy query of the token is row 0 of a second 16-row tile against the
// proxy keys of the same 32-key tiles (rows 1..15 zero).
//
// KL (only when asked, so it costs nothing otherwise): a second walk over the same tiles with
// the final lse of every head: teacher t_j = (1/G) sum_h exp(a_hj - lse_h) (a column sum over
// the tile rows), student log pp_j = s_j - lse_p; each warp writes its sum of
// t (log t - log pp) to a per-(b, p, i) slot of the workspace, and a one-CTA kernel reduces the
// slots in a fixed order (deterministic, no atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/instantiate.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/host/check.h"
#include "cuda/warmup/portable/warmup_portable.h"

namespace flash_msa::cuda::portable {

inline constexpr int kBlockKeys = static_cast<int>(kBlockSize);
inline constexpr int kTileKeys = 32;  // keys per shared-memory tile
inline constexpr int kSubTiles = kBlockKeys / kTileKeys;

template <int kD, int kDp>
struct ForwardConfig {
  static constexpr int kChunks = kD / 8;    // 16-byte chunks per K/V row
  static constexpr int kPChunks = kDp / 8;  // 16-byte chunks per Kp row
  // One pipeline stage of a warp: K tile, V tile, Kp tile (elements of 2 bytes).
  static constexpr int kStageElems = kTileKeys * (2 * kD + kDp);
  static constexpr int kWarpElems = 2 * kStageElems;
  static constexpr int kWarpBytes = kWarpElems * 2;
  // Up to 100 KiB per CTA: two CTAs per SM on Hopper/Blackwell (228 KiB), one on sm_80.
  static constexpr int kBudget = 100 * 1024;
  static constexpr int kWarps = kBudget / kWarpBytes >= 4 ? 4 : (kBudget / kWarpBytes >= 2 ? 2 : 1);
  static constexpr int kSmemBytes = kWarps * kWarpBytes;
};

// The warp-uniform sequence of 32-key tiles, from the token's document start to the token, that
// hold at least one visible key.
struct TileWalk {
  int block, last_block, doc_start, query;
  int sub = 0;

  // First key of the next tile, or -1 when the walk is done.
  __device__ int next() {
    while (block <= last_block) {
      const int key0 = block * kBlockKeys + sub * kTileKeys;
      if (++sub == kSubTiles) {
        sub = 0;
        ++block;
      }
      if (key0 <= query && key0 + kTileKeys > doc_start) return key0;
    }
    return -1;
  }
};

// Copies rows key0 .. key0+31 of a [S, C] slice into a swizzled tile; rows past `last_key`
// are zero-filled without reading global memory.
template <class T, int kRowChunks>
__device__ __forceinline__ void load_tile(T* tile, const T* base, int64_t stride_s, int key0,
                                          int last_key, int lane) {
#pragma unroll
  for (int c = lane; c < kTileKeys * kRowChunks; c += 32) {
    const int row = c / kRowChunks;
    const int chunk = c % kRowChunks;
    const int key = key0 + row;
    const bool valid = key <= last_key;
    const T* src = valid ? base + key * stride_s + chunk * 8 : base;
    cp_async_16(tile + swizzle<kRowChunks>(row, chunk) * 8, src, valid);
  }
}

// A fragments (row-major 16 x C) of a 16-row tile: this lane's rows lane/4 and lane/4 + 8 are
// row_lo and row_hi, or zero where null.
template <class T, int kC>
__device__ __forceinline__ void load_a_fragments(uint32_t (&a)[kC / 16][4], const T* row_lo,
                                                 const T* row_hi, int lane) {
  const int col = 2 * (lane % 4);
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks) {
    const int c = ks * 16 + col;
    a[ks][0] = row_lo ? *reinterpret_cast<const uint32_t*>(row_lo + c) : 0u;
    a[ks][1] = row_hi ? *reinterpret_cast<const uint32_t*>(row_hi + c) : 0u;
    a[ks][2] = row_lo ? *reinterpret_cast<const uint32_t*>(row_lo + c + 8) : 0u;
    a[ks][3] = row_hi ? *reinterpret_cast<const uint32_t*>(row_hi + c + 8) : 0u;
  }
}

// s[nt] = A (16 x C) * tile^T for the 32 keys of a swizzled [32, C] tile: 4 n-tiles of 8 keys.
template <class T, int kC>
__device__ __forceinline__ void scores(float (&s)[4][4], const uint32_t (&a)[kC / 16][4],
                                       const T* tile, int lane) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const int row = np * 16 + (lane % 8) + (lane / 16) * 8;
      const int chunk = ks * 2 + (lane / 8) % 2;
      uint32_t b[4];
      ldmatrix_x4(b, tile + swizzle<kC / 8>(row, chunk) * 8);
      const uint32_t b0[2] = {b[0], b[1]};
      const uint32_t b1[2] = {b[2], b[3]};
      mma_16x8x16<T>(s[2 * np], a[ks], b0);
      mma_16x8x16<T>(s[2 * np + 1], a[ks], b1);
    }
  }
}

// Scales scores to the log2 domain and masks keys outside [doc_start, query] to -inf.
// Element e of n-tile nt is key key0 + nt*8 + 2*(lane%4) + (e%2).
__device__ __forceinline__ void scale_and_mask(float (&s)[4][4], float scale_log2, int key0,
                                               int doc_start, int query, int lane) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + nt * 8 + 2 * (lane % 4) + (e % 2);
      s[nt][e] = (key <= query && key >= doc_start) ? s[nt][e] * scale_log2 : -INFINITY;
    }
}

// Online softmax update of one row pair (e in {0,1}: row lane/4; e in {2,3}: row lane/4 + 8).
// Returns the rescale factors of the two rows; s becomes exp2(s - m).
__device__ __forceinline__ float2 online_update(float (&s)[4][4], float (&m)[2], float (&l)[2]) {
  float2 alpha;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
    // Every tile of the walk holds a visible key, so the new maximum is finite.
    const float m_new = fmaxf(m[half], quad_max(mx));
    const float a = exp2f(m[half] - m_new);
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      s[nt][2 * half] = exp2f(s[nt][2 * half] - m_new);
      s[nt][2 * half + 1] = exp2f(s[nt][2 * half + 1] - m_new);
      sum += s[nt][2 * half] + s[nt][2 * half + 1];
    }
    l[half] = l[half] * a + sum;  // lane-partial; the quad sum is taken at the end
    m[half] = m_new;
    (half == 0 ? alpha.x : alpha.y) = a;
  }
  return alpha;
}

template <class T, int kD, int kDp>
__global__ void __launch_bounds__(ForwardConfig<kD, kDp>::kWarps * 32)
    forward_kernel(const ForwardKernelParams p) {
  using Cfg = ForwardConfig<kD, kDp>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int qi = blockIdx.x * Cfg::kWarps + warp;  // index of the query in the query-side views
  if (qi >= p.shape.queries) return;  // warps share nothing, so an idle warp may leave
  const int query = p.shape.query_offset + qi;  // its position
  const int ph = blockIdx.y;
  const int b = blockIdx.z;

  T* warp_smem = reinterpret_cast<T*>(smem_raw) + warp * Cfg::kWarpElems;

  // Start of the query's document within its batch row.
  int doc_start = 0;
  if (p.cu_seqlens) {
    const int token = b * p.shape.seqlen + query;
    int lo = 0, hi = p.shape.num_docs;  // largest d with cu_seqlens[d] <= token
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (__ldg(p.cu_seqlens + mid) <= token)
        lo = mid;
      else
        hi = mid;
    }
    doc_start = max(0, __ldg(p.cu_seqlens + lo) - b * p.shape.seqlen);
  }

  const int head0 = ph * p.shape.group;
  const int kv_head = head0 / p.shape.kv_group;
  const int pk_head = ph / p.shape.proxy_group;
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.stride_b + qi * p.q.stride_s;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.stride_b + kv_head * p.k.stride_h;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.stride_b + kv_head * p.v.stride_h;
  const T* kp = static_cast<const T*>(p.kp.data) + b * p.kp.stride_b + pk_head * p.kp.stride_h;
  const T* qp = static_cast<const T*>(p.qp.data) + b * p.qp.stride_b + ph * p.qp.stride_h +
                qi * p.qp.stride_s;

  const int r_lo = lane / 4;
  const int r_hi = r_lo + 8;
  uint32_t qf[kD / 16][4];
  load_a_fragments<T, kD>(qf, r_lo < p.shape.group ? q + (head0 + r_lo) * p.q.stride_h : nullptr,
                          r_hi < p.shape.group ? q + (head0 + r_hi) * p.q.stride_h : nullptr, lane);
  uint32_t qpf[kDp / 16][4];
  load_a_fragments<T, kDp>(qpf, r_lo == 0 ? qp : nullptr, nullptr, lane);

  const int64_t row = p.shape.query_row(int64_t(b) * p.shape.proxy_heads + ph, query);
  const TileWalk walk0{doc_start / kBlockKeys, query / kBlockKeys, doc_start, query};

  auto load_stage = [&](int stage, int key0, bool with_v) {
    T* st = warp_smem + stage * Cfg::kStageElems;
    load_tile<T, Cfg::kChunks>(st, k, p.k.stride_s, key0, query, lane);
    if (with_v) load_tile<T, Cfg::kChunks>(st + kTileKeys * kD, v, p.v.stride_s, key0, query, lane);
    load_tile<T, Cfg::kPChunks>(st + 2 * kTileKeys * kD, kp, p.kp.stride_s, key0, query, lane);
    cp_async_commit();
  };

  // ---- pass 1: main online softmax and proxy log-sum-exp ----
  float o[kD / 8][4];
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float mp[2] = {-INFINITY, -INFINITY}, lp[2] = {0.f, 0.f};

  TileWalk walk = walk0;
  int key_cur = walk.next();
  if (key_cur >= 0) load_stage(0, key_cur, true);
  for (int stage = 0; key_cur >= 0; stage ^= 1) {
    const int key_next = walk.next();
    if (key_next >= 0) load_stage(stage ^ 1, key_next, true);
    if (key_next >= 0)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    __syncwarp();
    const T* kt = warp_smem + stage * Cfg::kStageElems;
    const T* vt = kt + kTileKeys * kD;
    const T* kpt = kt + 2 * kTileKeys * kD;

    float s[4][4];
    scores<T, kD>(s, qf, kt, lane);
    scale_and_mask(s, p.shape.scale_log2, key_cur, doc_start, query, lane);
    const float2 alpha = online_update(s, m, l);
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      o[dt][0] *= alpha.x;
      o[dt][1] *= alpha.x;
      o[dt][2] *= alpha.y;
      o[dt][3] *= alpha.y;
    }
    // P (16 x 32) as A fragments of two 16-key steps, times the V tile.
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const uint32_t a[4] = {Elem<T>::pack(s[2 * ks][0], s[2 * ks][1]),
                             Elem<T>::pack(s[2 * ks][2], s[2 * ks][3]),
                             Elem<T>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             Elem<T>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        const int vrow = ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int chunk = dp * 2 + lane / 16;
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, vt + swizzle<Cfg::kChunks>(vrow, chunk) * 8);
        const uint32_t b0[2] = {bv[0], bv[1]};
        const uint32_t b1[2] = {bv[2], bv[3]};
        mma_16x8x16<T>(o[2 * dp], a, b0);
        mma_16x8x16<T>(o[2 * dp + 1], a, b1);
      }
    }

    float sp[4][4];
    scores<T, kDp>(sp, qpf, kpt, lane);
    scale_and_mask(sp, p.shape.proxy_scale_log2, key_cur, doc_start, query, lane);
    online_update(sp, mp, lp);

    __syncwarp();  // every lane is done with this stage before it is refilled
    key_cur = key_next;
  }

  const float l_lo = quad_sum(l[0]);
  const float l_hi = quad_sum(l[1]);
  const float lp_row0 = quad_sum(lp[0]);
  constexpr float kLn2 = 0.6931471805599453f;
  // log2-domain lse of each row; the walk always holds the token itself, so l > 0.
  const float lse2_lo = m[0] + __log2f(l_lo);
  const float lse2_hi = m[1] + __log2f(l_hi);
  const float lse2_p = mp[0] + __log2f(lp_row0);
  const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f;
  const float inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;

  T* out = static_cast<T*>(p.out.data) + b * p.out.stride_b + qi * p.out.stride_s;
  const int col = 2 * (lane % 4);
  if (r_lo < p.shape.group) {
    T* orow = out + (head0 + r_lo) * p.out.stride_h;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
      *reinterpret_cast<uint32_t*>(orow + dt * 8 + col) =
          Elem<T>::pack(o[dt][0] * inv_lo, o[dt][1] * inv_lo);
    if (lane % 4 == 0)
      p.lse[p.shape.query_row(int64_t(b) * p.shape.heads + head0 + r_lo, query)] =
          l_lo > 0.f ? lse2_lo * kLn2 : -INFINITY;
  }
  if (r_hi < p.shape.group) {
    T* orow = out + (head0 + r_hi) * p.out.stride_h;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
      *reinterpret_cast<uint32_t*>(orow + dt * 8 + col) =
          Elem<T>::pack(o[dt][2] * inv_hi, o[dt][3] * inv_hi);
    if (lane % 4 == 0)
      p.lse[p.shape.query_row(int64_t(b) * p.shape.heads + head0 + r_hi, query)] =
          l_hi > 0.f ? lse2_hi * kLn2 : -INFINITY;
  }
  if (lane == 0) p.lse_proxy[row] = lp_row0 > 0.f ? lse2_p * kLn2 : -INFINITY;

  if (!p.kl_partial) return;

  // ---- pass 2 (KL only): teacher from the final main probabilities, student from lse_p ----
  const float lse_p = lse2_p * kLn2;
  const float inv_group = 1.f / p.shape.group;
  const bool lo_active = r_lo < p.shape.group;
  const bool hi_active = r_hi < p.shape.group;
  float kl = 0.f;
  walk = walk0;
  key_cur = walk.next();
  if (key_cur >= 0) load_stage(0, key_cur, false);
  for (int stage = 0; key_cur >= 0; stage ^= 1) {
    const int key_next = walk.next();
    if (key_next >= 0) load_stage(stage ^ 1, key_next, false);
    if (key_next >= 0)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    __syncwarp();
    const T* kt = warp_smem + stage * Cfg::kStageElems;
    const T* kpt = kt + 2 * kTileKeys * kD;

    float s[4][4];
    scores<T, kD>(s, qf, kt, lane);
    scale_and_mask(s, p.shape.scale_log2, key_cur, doc_start, query, lane);
    float sp[4][4];
    scores<T, kDp>(sp, qpf, kpt, lane);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // Column sum over the 16 rows: this lane's two rows, then the 8 row groups.
        float t = (lo_active ? exp2f(s[nt][e] - lse2_lo) : 0.f) +
                  (hi_active ? exp2f(s[nt][e + 2] - lse2_hi) : 0.f);
        t += __shfl_xor_sync(0xffffffffu, t, 4);
        t += __shfl_xor_sync(0xffffffffu, t, 8);
        t += __shfl_xor_sync(0xffffffffu, t, 16);
        t *= inv_group;
        // Lanes 0..3 hold row 0 (the proxy row) of the same columns.
        const int key = key_cur + nt * 8 + col + e;
        if (lane < 4 && !(t <= 0.f) && key <= query && key >= doc_start) {
          const float log_pp = sp[nt][e] * (p.shape.proxy_scale_log2 * kLn2) - lse_p;
          kl += t * (__logf(t) - log_pp);
        }
      }

    __syncwarp();
    key_cur = key_next;
  }
  kl = quad_sum(kl);
  if (lane == 0) p.kl_partial[row] = kl;
}

template <class T, int kD, int kDp>
void launch_forward(const ForwardKernelParams& params, cudaStream_t stream) {
  using Cfg = ForwardConfig<kD, kDp>;
  const auto kernel = forward_kernel<T, kD, kDp>;
  FLASH_MSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const dim3 grid((params.shape.queries + Cfg::kWarps - 1) / Cfg::kWarps, params.shape.proxy_heads,
                  params.shape.batch);
  kernel<<<grid, Cfg::kWarps * 32, Cfg::kSmemBytes, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::portable

// One explicit instantiation for element type T (FLASH_MSA_INSTANTIATE, common/instantiate.h).
#define FLASH_MSA_WARMUP_FORWARD_DIM(T, D, DP) \
  template void launch_forward<T, D, DP>(const ForwardKernelParams&, cudaStream_t);
