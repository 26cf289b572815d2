// Portable (mma.sync) dense MSA backward: warmup mode (SPEC section 5, the section 4 formulas
// over every visible key). The sparse mode runs key-block-outer
// (backward/portable/sparse_kernel.cuh).
//
// Design: deterministic by construction, with no floating-point atomics anywhere (runs are
// bitwise reproducible). Four kernels on the caller's stream:
//  1. delta: Delta(h, i) = <o, dO> in fp32 into the workspace.
//  2. dq/dqp, query-outer (as the forward): one warp per (b, proxy head p, token i) owns a
//     16-row MMA tile of the G heads of the group and walks the token's visible 32-key tiles:
//     S = Q K^T, P = exp(scale*S - lse), dP = dO V^T, dS = P (dP - Delta), dQ += dS K in
//     registers; the proxy row (row 0 of a padded tile) gets t = mean over the G rows of P,
//     pp = exp(proxy_scale*Sp - lse_p), g = w (pp - t) / (B*Hp*S), dqp += g Kp. Each dq/dqp row
//     is written exactly once.
//  3. dk/dv/dkp, key-outer: one CTA per (b, p, key block n) keeps the block's K, V, Kp in shared
//     memory, warp w owning keys 16w..16w+15, and walks the tokens that see block n (from
//     128 n to the end of the documents the block overlaps) in windows of 256, compacted in
//     token order with ballots. Per 16 tokens and per head h of the group it computes the
//     transposed tiles S^T = K Q^T and dP^T = V dO^T (keys as MMA rows, so P^T and dS^T are
//     already the A operands of dV += P^T dO and dK += dS^T Q, accumulated in registers); t^T is
//     the sum of P^T over the heads, and dKp += g^T qp accumulates in fp32 shared memory
//     (registers are taken by dK/dV). The CTA writes its partial dk/dv/dkp of proxy head p once.
//  4. reduce: dk/dv of kv head c = sum of the partials of the proxy heads inside kv group c,
//     dkp of proxy key head c = sum over its proxy heads, in a fixed order, cast to the dtype.
// Shared memory at D = Dp = 128: 144 KiB per dq CTA, 174 KiB per dk/dv CTA (more than sm_80's
// 163 KiB: that configuration runs on sm_90/sm_100 only; the launch reports the CUDA error).
// All matrix products run on tensor cores (m16n8k16, fp32 accumulation); transposed operands
// come from ldmatrix .trans on swizzled shared-memory tiles.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/documents.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/host/check.h"
#include "cuda/warmup/portable/warmup_portable.h"

namespace flash_msa::cuda::portable::backward {

inline constexpr int kBlockKeys = static_cast<int>(kBlockSize);
inline constexpr int kTileKeys = 32;  // keys per tile of the query-outer walk
inline constexpr int kSubTiles = kBlockKeys / kTileKeys;
inline constexpr int kDqWarps = 4;                // query-outer: tokens per CTA
inline constexpr int kKvWarps = kBlockKeys / 16;  // key-outer: one warp per 16 keys
inline constexpr int kKvThreads = kKvWarps * 32;
inline constexpr int kGroupTokens = 16;  // key-outer: member tokens per MMA step
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// A operand (row-major 16 x 16, rows row0.., k-step ks) from a swizzled [rows, C] tile.
template <int kRowChunks, class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int row0, int ks,
                                       int lane) {
  const int mi = lane / 8;
  const int row = row0 + (mi % 2) * 8 + lane % 8;
  ldmatrix_x4(a, tile + swizzle<kRowChunks>(row, ks * 2 + mi / 2) * 8);
}

// B operands of two n-tiles (tile rows row0..row0+7 and row0+8..row0+15 as the n index, the
// channels of k-step ks as k): B = tile^T. b[0..1]: first n-tile, b[2..3]: second.
template <int kRowChunks, class T>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const T* tile, int row0, int ks,
                                       int lane) {
  const int row = row0 + (lane % 8) + (lane / 16) * 8;
  ldmatrix_x4(b, tile + swizzle<kRowChunks>(row, ks * 2 + (lane / 8) % 2) * 8);
}

// B operands of two n-tiles from a [k rows, n channels] tile (B = tile): rows k0..k0+15 as k,
// channels 16 np .. 16 np + 15 as n. b[0..1]: channels 16np.., b[2..3]: 16np+8...
template <int kRowChunks, class T>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const T* tile, int k0, int np,
                                             int lane) {
  const int row = k0 + ((lane / 8) % 2) * 8 + lane % 8;
  ldmatrix_x4_trans(b, tile + swizzle<kRowChunks>(row, 2 * np + lane / 16) * 8);
}

// The A operand of a product whose k index is the n index of two accumulator n-tiles.
template <class T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                       const float (&hi)[4]) {
  a[0] = Elem<T>::pack(lo[0], lo[1]);
  a[1] = Elem<T>::pack(lo[2], lo[3]);
  a[2] = Elem<T>::pack(hi[0], hi[1]);
  a[3] = Elem<T>::pack(hi[2], hi[3]);
}

// acc[2 np], acc[2 np + 1] += A * B for the two n-tiles of b.
template <class T>
__device__ __forceinline__ void mma_pair(float (&lo)[4], float (&hi)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]};
  const uint32_t b1[2] = {b[2], b[3]};
  mma_16x8x16<T>(lo, a, b0);
  mma_16x8x16<T>(hi, a, b1);
}

// Copies `rows` rows of C channels from base + r * stride into a swizzled tile; rows >= valid
// are zero-filled without a global read.
template <int kRowChunks, class T>
__device__ __forceinline__ void load_rows(T* tile, const T* base, int64_t stride, int rows,
                                          int valid, int tid, int threads) {
  for (int c = tid; c < rows * kRowChunks; c += threads) {
    const int row = c / kRowChunks, chunk = c % kRowChunks;
    const bool ok = row < valid;
    const T* src = ok ? base + row * stride + chunk * 8 : base;
    cp_async_16(tile + swizzle<kRowChunks>(row, chunk) * 8, src, ok);
  }
}

__device__ __forceinline__ float read_weight(const BackwardKernelParams& p) {
  return (p.kl_grad ? __ldg(p.kl_grad) : 0.f) * p.shape.inv_rows;
}

// ---- 1. Delta ----

template <class T, int kD>
__global__ void delta_kernel(const BackwardKernelParams p) {
  constexpr int kChunks = kD / 8;
  const int lane = threadIdx.x % 32;
  const int64_t rows = int64_t(p.shape.batch) * p.shape.heads * p.shape.queries;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int i = static_cast<int>(r % p.shape.queries);  // the query's index in the views
    const int h = static_cast<int>((r / p.shape.queries) % p.shape.heads);
    const int b = static_cast<int>(r / (int64_t(p.shape.queries) * p.shape.heads));
    float acc = 0.f;
    if (lane < kChunks) {
      const T* o = static_cast<const T*>(p.out.data) + b * p.out.stride_b + h * p.out.stride_h +
                   i * p.out.stride_s + lane * 8;
      const T* g = static_cast<const T*>(p.dout.data) + b * p.dout.stride_b + h * p.dout.stride_h +
                   i * p.dout.stride_s + lane * 8;
      const uint4 ov = *reinterpret_cast<const uint4*>(o);
      const uint4 gv = *reinterpret_cast<const uint4*>(g);
      const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, gw[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 a = Elem<T>::unpack(ow[w]), c = Elem<T>::unpack(gw[w]);
        acc += a.x * c.x + a.y * c.y;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) p.delta[r] = acc;
  }
}

// ---- 2. dq / dqp, query-outer ----

template <int kD, int kDp>
struct DqConfig {
  // Q, dO (16 rows), the proxy query (row 0 of a zero-padded 16-row tile), K, V, Kp tiles.
  static constexpr int kWarpElems = 2 * 16 * kD + 16 * kDp + kTileKeys * (2 * kD + kDp);
  static constexpr int kSmemBytes = kDqWarps * kWarpElems * 2;
};

template <class T, int kD, int kDp>
__global__ void __launch_bounds__(kDqWarps * 32) dq_kernel(const BackwardKernelParams p) {
  constexpr int kC = kD / 8, kPC = kDp / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int qi = blockIdx.x * kDqWarps + warp;  // the query's index in the query-side views
  const int pr = blockIdx.y, b = blockIdx.z;
  if (qi >= p.shape.queries) return;  // warp-uniform; the kernel has no CTA-wide barrier
  const int i = p.shape.query_offset + qi;  // its position
  T* sQ = reinterpret_cast<T*>(smem_raw) + warp * DqConfig<kD, kDp>::kWarpElems;
  T* sdO = sQ + 16 * kD;
  T* sQp = sdO + 16 * kD;
  T* sK = sQp + 16 * kDp;
  T* sV = sK + kTileKeys * kD;
  T* sKp = sV + kTileKeys * kD;

  const int G = p.shape.group, h0 = pr * G;
  const int kvh = h0 / p.shape.kv_group, pkh = pr / p.shape.proxy_group;
  const int ds = doc_start_of(p.cu_seqlens, p.shape.num_docs, b, i, p.shape.seqlen);
  const int own = i / kBlockKeys;

  load_rows<kC>(
      sQ, static_cast<const T*>(p.q.data) + b * p.q.stride_b + h0 * p.q.stride_h + qi * p.q.stride_s,
      p.q.stride_h, 16, G, lane, 32);
  load_rows<kC>(sdO,
                static_cast<const T*>(p.dout.data) + b * p.dout.stride_b + h0 * p.dout.stride_h +
                    qi * p.dout.stride_s,
                p.dout.stride_h, 16, G, lane, 32);
  load_rows<kPC>(
      sQp,
      static_cast<const T*>(p.qp.data) + b * p.qp.stride_b + pr * p.qp.stride_h + qi * p.qp.stride_s,
      0, 16, 1, lane, 32);
  cp_async_commit();

  const int r_lo = lane / 4, r_hi = lane / 4 + 8;
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? r_hi : r_lo;
    const int64_t row = p.shape.query_row(int64_t(b) * p.shape.heads + h0 + r, i);
    lse2[half] = r < G ? __ldg(p.lse + row) * kLog2e : 0.f;
    delta[half] = r < G ? p.delta[row] : 0.f;
  }
  const float lsep2 =
      __ldg(p.lse_proxy + p.shape.query_row(int64_t(b) * p.shape.proxy_heads + pr, i)) * kLog2e;
  const float sl2 = p.shape.scale * kLog2e, psl2 = p.shape.proxy_scale * kLog2e;
  const float wscale = read_weight(p);
  const float inv_g = 1.f / G;

  float dq[kD / 8][4] = {};
  // Only row 0 of the padded proxy product is real: keep its two columns per n-tile (lanes 0..3).
  float dqp[kDp / 8][2] = {};
  float kl = 0.f;  // the row's KL term t (ln t - ln pp), summed over this lane's keys (kl_rows)

  const T* kbase = static_cast<const T*>(p.k.data) + b * p.k.stride_b + kvh * p.k.stride_h;
  const T* vbase = static_cast<const T*>(p.v.data) + b * p.v.stride_b + kvh * p.v.stride_h;
  const T* kpbase = static_cast<const T*>(p.kp.data) + b * p.kp.stride_b + pkh * p.kp.stride_h;
  for (int n = ds / kBlockKeys; n <= own; ++n) {
    for (int sub = 0; sub < kSubTiles; ++sub) {
      const int key0 = n * kBlockKeys + sub * kTileKeys;
      if (key0 > i || key0 + kTileKeys <= ds) continue;
      const int valid = min(kTileKeys, i - key0 + 1);
      __syncwarp();  // the previous tile's ldmatrix reads are done before it is overwritten
      load_rows<kC>(sK, kbase + key0 * p.k.stride_s, p.k.stride_s, kTileKeys, valid, lane, 32);
      load_rows<kC>(sV, vbase + key0 * p.v.stride_s, p.v.stride_s, kTileKeys, valid, lane, 32);
      load_rows<kPC>(sKp, kpbase + key0 * p.kp.stride_s, p.kp.stride_s, kTileKeys, valid, lane, 32);
      cp_async_commit();
      cp_async_wait<0>();
      __syncwarp();

      // Ordered to keep few tiles live: S, dP -> P, dS and the column sums of P -> dQ; then
      // the proxy scores -> g -> dQp.
      float s[4][4] = {}, dp[4][4] = {};
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        uint32_t a[4], bb[4];
        load_a<kC>(a, sQ, 0, ks, lane);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          load_b<kC>(bb, sK, np * 16, ks, lane);
          mma_pair<T>(s[2 * np], s[2 * np + 1], a, bb);
        }
        load_a<kC>(a, sdO, 0, ks, lane);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          load_b<kC>(bb, sV, np * 16, ks, lane);
          mma_pair<T>(dp[2 * np], dp[2 * np + 1], a, bb);
        }
      }
      float t[4][2];  // teacher: mean over the G heads of P, per key of this lane's columns
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = (e / 2) ? r_hi : r_lo;
          const int key = key0 + nt * 8 + 2 * (lane % 4) + (e % 2);
          const bool vis = r < G && key <= i && key >= ds;
          const float pe = vis ? exp2f(s[nt][e] * sl2 - lse2[e / 2]) : 0.f;
          s[nt][e] = pe;
          dp[nt][e] = pe * (dp[nt][e] - delta[e / 2]);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float c = s[nt][e] + s[nt][e + 2];
          c += __shfl_xor_sync(0xffffffffu, c, 4);
          c += __shfl_xor_sync(0xffffffffu, c, 8);
          c += __shfl_xor_sync(0xffffffffu, c, 16);
          t[nt][e] = c * inv_g;
        }
      }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint32_t a[4];
        c_to_a<T>(a, dp[2 * ks], dp[2 * ks + 1]);
#pragma unroll
        for (int np = 0; np < kD / 16; ++np) {
          uint32_t bb[4];
          load_b_trans<kC>(bb, sK, ks * 16, np, lane);
          mma_pair<T>(dq[2 * np], dq[2 * np + 1], a, bb);
        }
      }
      float sp[4][4] = {};
#pragma unroll
      for (int ks = 0; ks < kDp / 16; ++ks) {
        uint32_t a[4];
        load_a<kPC>(a, sQp, 0, ks, lane);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bb[4];
          load_b<kPC>(bb, sKp, np * 16, ks, lane);
          mma_pair<T>(sp[2 * np], sp[2 * np + 1], a, bb);
        }
      }
      // g / (w / (B Hp S)) = pp - t for the proxy row (row 0: lanes 0..3); the factor is
      // applied at the end so that the 16-bit operand stays in [-1, 1] (it underflows in fp16).
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + nt * 8 + 2 * (lane % 4) + (e % 2);
          const bool vis = lane < 4 && e < 2 && key <= i && key >= ds;
          const float log2_pp = sp[nt][e] * psl2 - lsep2, tv = t[nt][e % 2];
          if (p.kl_rows && vis && !(tv <= 0.f)) kl += tv * (__logf(tv) - log2_pp * kLn2);
          sp[nt][e] = vis ? exp2f(log2_pp) - tv : 0.f;
        }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint32_t ag[4];
        c_to_a<T>(ag, sp[2 * ks], sp[2 * ks + 1]);
#pragma unroll
        for (int np = 0; np < kDp / 16; ++np) {
          uint32_t bb[4];
          load_b_trans<kPC>(bb, sKp, ks * 16, np, lane);
          float c[2][4] = {};
          mma_pair<T>(c[0], c[1], ag, bb);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            dqp[2 * np + j][0] += c[j][0];
            dqp[2 * np + j][1] += c[j][1];
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // Q/dO were never waited on when the walk was empty
  if (p.kl_rows) {  // warp-uniform
    kl = quad_sum(kl);
    if (lane == 0) p.kl_rows[p.shape.query_row(int64_t(b) * p.shape.proxy_heads + pr, i)] = kl;
  }

  T* dqb = static_cast<T*>(p.dq.data) + b * p.dq.stride_b + h0 * p.dq.stride_h + qi * p.dq.stride_s;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? r_hi : r_lo;
    if (r >= G) continue;
#pragma unroll
    for (int nt = 0; nt < kD / 8; ++nt) {
      const int c = nt * 8 + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(dqb + r * p.dq.stride_h + c) =
          Elem<T>::pack(dq[nt][2 * half] * p.shape.scale, dq[nt][2 * half + 1] * p.shape.scale);
    }
  }
  if (lane < 4) {
    const float proxy_w = p.shape.proxy_scale * wscale;
    T* dqpb =
        static_cast<T*>(p.dqp.data) + b * p.dqp.stride_b + pr * p.dqp.stride_h + qi * p.dqp.stride_s;
#pragma unroll
    for (int nt = 0; nt < kDp / 8; ++nt) {
      const int c = nt * 8 + 2 * lane;
      *reinterpret_cast<uint32_t*>(dqpb + c) =
          Elem<T>::pack(dqp[nt][0] * proxy_w, dqp[nt][1] * proxy_w);
    }
  }
}

// ---- 3. dk / dv / dkp partials, key-outer ----

template <int kD, int kDp>
struct KvConfig {
  static constexpr int kWindow = kKvThreads;  // tokens scanned per membership window
  // Element offsets (2-byte elements) of the tiles, then fp32 and int arrays.
  static constexpr int kK = 0;
  static constexpr int kV = kK + kBlockKeys * kD;
  static constexpr int kKp = kV + kBlockKeys * kD;
  static constexpr int kQ = kKp + kBlockKeys * kDp;
  static constexpr int kDo = kQ + kGroupTokens * kD;
  static constexpr int kQp = kDo + kGroupTokens * kD;
  static constexpr int kElems = kQp + kGroupTokens * kDp;
  static constexpr int kDkpBytes = kBlockKeys * kDp * 4;
  static constexpr int kListBytes = 2 * kWindow * 4;
  static constexpr int kRowBytes = 5 * kGroupTokens * 4;  // lse2, delta, lsep2, token, doc start
  static constexpr int kSmemBytes = kElems * 2 + kDkpBytes + kListBytes + kRowBytes + kKvWarps * 4;
};

template <class T, int kD, int kDp>
__global__ void __launch_bounds__(kKvThreads) dkv_kernel(const BackwardKernelParams p) {
  using Cfg = KvConfig<kD, kDp>;
  constexpr int kC = kD / 8, kPC = kDp / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const tiles = reinterpret_cast<T*>(smem_raw);
  T* sK = tiles + Cfg::kK;
  T* sV = tiles + Cfg::kV;
  T* sKp = tiles + Cfg::kKp;
  T* sQ = tiles + Cfg::kQ;
  T* sdO = tiles + Cfg::kDo;
  T* sQp = tiles + Cfg::kQp;
  float* sdKp = reinterpret_cast<float*>(smem_raw + Cfg::kElems * 2);  // [128, Dp]
  int* list_tok = reinterpret_cast<int*>(smem_raw + Cfg::kElems * 2 + Cfg::kDkpBytes);
  int* list_ds = list_tok + Cfg::kWindow;
  float* s_lse2 = reinterpret_cast<float*>(list_ds + Cfg::kWindow);
  float* s_delta = s_lse2 + kGroupTokens;
  float* s_lsep2 = s_delta + kGroupTokens;
  int* s_tok = reinterpret_cast<int*>(s_lsep2 + kGroupTokens);
  int* s_ds = s_tok + kGroupTokens;
  int* warp_count = s_ds + kGroupTokens;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n = blockIdx.x, pr = blockIdx.y, b = blockIdx.z;
  const int G = p.shape.group, h0 = pr * G;
  const int kvh = h0 / p.shape.kv_group, pkh = pr / p.shape.proxy_group;
  const int key_base = n * kBlockKeys;
  const int keys_valid = min(kBlockKeys, p.shape.seqlen - key_base);

  load_rows<kC>(sK,
                static_cast<const T*>(p.k.data) + b * p.k.stride_b + kvh * p.k.stride_h +
                    key_base * p.k.stride_s,
                p.k.stride_s, kBlockKeys, keys_valid, tid, kKvThreads);
  load_rows<kC>(sV,
                static_cast<const T*>(p.v.data) + b * p.v.stride_b + kvh * p.v.stride_h +
                    key_base * p.v.stride_s,
                p.v.stride_s, kBlockKeys, keys_valid, tid, kKvThreads);
  load_rows<kPC>(sKp,
                 static_cast<const T*>(p.kp.data) + b * p.kp.stride_b + pkh * p.kp.stride_h +
                     key_base * p.kp.stride_s,
                 p.kp.stride_s, kBlockKeys, keys_valid, tid, kKvThreads);
  cp_async_commit();
  for (int e = tid; e < kBlockKeys * kDp; e += kKvThreads) sdKp[e] = 0.f;

  const float sl2 = p.shape.scale * kLog2e, psl2 = p.shape.proxy_scale * kLog2e;
  const float wscale = read_weight(p);
  const float inv_g = 1.f / G;
  const int row0 = warp * 16;
  const int key_lo = key_base + row0 + lane / 4;  // this lane's keys: key_lo, key_lo + 8

  float dk[kD / 8][4] = {};
  float dv[kD / 8][4] = {};

  const T* qbase = static_cast<const T*>(p.q.data) + b * p.q.stride_b;
  const T* dobase = static_cast<const T*>(p.dout.data) + b * p.dout.stride_b;
  const T* qpbase = static_cast<const T*>(p.qp.data) + b * p.qp.stride_b + pr * p.qp.stride_h;

  // The queries at positions from the block on (tokens at positions; q-side reads at query_at).
  const int q_end = p.shape.query_offset + p.shape.queries;
  for (int win = max(key_base, p.shape.query_offset); win < q_end; win += Cfg::kWindow) {
    const int tok = win + tid;
    bool member = false;
    int ds = 0;
    if (tok < q_end) {
      ds = doc_start_of(p.cu_seqlens, p.shape.num_docs, b, tok, p.shape.seqlen);
      member = key_base + kBlockKeys > ds;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, member);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int base = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kKvWarps; ++w) {
      const int c = warp_count[w];
      base += w < warp ? c : 0;
      total += c;
    }
    if (member) {
      const int pos = base + __popc(ballot & ((1u << lane) - 1u));
      list_tok[pos] = tok;
      list_ds[pos] = ds;
    }
    __syncthreads();

    for (int g0 = 0; g0 < total; g0 += kGroupTokens) {
      const int m = min(kGroupTokens, total - g0);
      float t[2][4] = {};
      for (int hh = 0; hh < G; ++hh) {
        const int h = h0 + hh;
        for (int c = tid; c < 2 * kGroupTokens * kC; c += kKvThreads) {
          const bool is_do = c >= kGroupTokens * kC;
          const int cc = is_do ? c - kGroupTokens * kC : c;
          const int r = cc / kC, chunk = cc % kC;
          const bool ok = r < m;
          const int tr = ok ? list_tok[g0 + r] : 0;
          const int qr = ok ? p.shape.query_at(tr) : 0;
          const T* src = is_do ? dobase + h * p.dout.stride_h + qr * p.dout.stride_s
                               : qbase + h * p.q.stride_h + qr * p.q.stride_s;
          cp_async_16((is_do ? sdO : sQ) + swizzle<kC>(r, chunk) * 8, src + chunk * 8, ok);
        }
        cp_async_commit();
        if (tid < kGroupTokens) {
          const bool ok = tid < m;
          const int tr = ok ? list_tok[g0 + tid] : p.shape.query_offset;
          const int64_t row = p.shape.query_row(int64_t(b) * p.shape.heads + h, tr);
          s_lse2[tid] = ok ? __ldg(p.lse + row) * kLog2e : 0.f;
          s_delta[tid] = ok ? p.delta[row] : 0.f;
          s_tok[tid] = ok ? tr : -1;  // -1: no key is <= it, so the column is masked
          s_ds[tid] = ok ? list_ds[g0 + tid] : 0;
        }
        cp_async_wait<0>();
        __syncthreads();

        float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
          uint32_t a[4], bb[4];
          load_a<kC>(a, sK, row0, ks, lane);
          load_b<kC>(bb, sQ, 0, ks, lane);
          mma_pair<T>(s[0], s[1], a, bb);
          load_a<kC>(a, sV, row0, ks, lane);
          load_b<kC>(bb, sdO, 0, ks, lane);
          mma_pair<T>(dp[0], dp[1], a, bb);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key_lo + (e / 2) * 8;
            const int tr = nt * 8 + 2 * (lane % 4) + (e % 2);
            const bool vis = key <= s_tok[tr] && key >= s_ds[tr];
            const float pe = vis ? exp2f(s[nt][e] * sl2 - s_lse2[tr]) : 0.f;
            s[nt][e] = pe;
            t[nt][e] += pe;
            dp[nt][e] = pe * (dp[nt][e] - s_delta[tr]);
          }
        uint32_t ap[4], ads[4];
        c_to_a<T>(ap, s[0], s[1]);
        c_to_a<T>(ads, dp[0], dp[1]);
#pragma unroll
        for (int np = 0; np < kD / 16; ++np) {
          uint32_t bb[4];
          load_b_trans<kC>(bb, sdO, 0, np, lane);
          mma_pair<T>(dv[2 * np], dv[2 * np + 1], ap, bb);
          load_b_trans<kC>(bb, sQ, 0, np, lane);
          mma_pair<T>(dk[2 * np], dk[2 * np + 1], ads, bb);
        }
        __syncthreads();  // sQ/sdO and the row arrays are reloaded next
      }

      // Proxy branch of these tokens: dKp += (pp - t)^T qp; the factor w / (B Hp S) is applied
      // at the end so that the 16-bit MMA operand stays in [-1, 1] (it underflows in fp16).
      for (int c = tid; c < kGroupTokens * kPC; c += kKvThreads) {
        const int r = c / kPC, chunk = c % kPC;
        const bool ok = r < m;
        const int qr = ok ? p.shape.query_at(list_tok[g0 + r]) : 0;
        cp_async_16(sQp + swizzle<kPC>(r, chunk) * 8, qpbase + qr * p.qp.stride_s + chunk * 8, ok);
      }
      cp_async_commit();
      if (tid < kGroupTokens) {
        const bool ok = tid < m;
        const int tr = ok ? list_tok[g0 + tid] : p.shape.query_offset;
        s_lsep2[tid] =
            ok ? __ldg(p.lse_proxy + p.shape.query_row(int64_t(b) * p.shape.proxy_heads + pr, tr)) *
                     kLog2e
               : 0.f;
        s_tok[tid] = ok ? tr : -1;
        s_ds[tid] = ok ? list_ds[g0 + tid] : 0;
      }
      cp_async_wait<0>();
      __syncthreads();
      float sp[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < kDp / 16; ++ks) {
        uint32_t a[4], bb[4];
        load_a<kPC>(a, sKp, row0, ks, lane);
        load_b<kPC>(bb, sQp, 0, ks, lane);
        mma_pair<T>(sp[0], sp[1], a, bb);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_lo + (e / 2) * 8;
          const int tr = nt * 8 + 2 * (lane % 4) + (e % 2);
          const bool vis = key <= s_tok[tr] && key >= s_ds[tr];
          sp[nt][e] = vis ? exp2f(sp[nt][e] * psl2 - s_lsep2[tr]) - t[nt][e] * inv_g : 0.f;
        }
      uint32_t ag[4];
      c_to_a<T>(ag, sp[0], sp[1]);
#pragma unroll
      for (int np = 0; np < kDp / 16; ++np) {
        uint32_t bb[4];
        load_b_trans<kPC>(bb, sQp, 0, np, lane);
        float c[2][4] = {};
        mma_pair<T>(c[0], c[1], ag, bb);
        // Each accumulator element belongs to one lane of one warp: plain read-modify-write.
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = row0 + lane / 4 + (e / 2) * 8;
            const int col = np * 16 + j * 8 + 2 * (lane % 4) + (e % 2);
            sdKp[row * kDp + col] += c[j][e];
          }
      }
      __syncthreads();  // sQp and the row arrays are reloaded by the next group
    }
    __syncthreads();  // the member list is rebuilt by the next window
  }
  cp_async_wait<0>();  // K/V/Kp were never waited on when no token attends the block
  __syncthreads();

  const int64_t part = (int64_t(b) * p.shape.proxy_heads + pr) * p.shape.seqlen;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_lo + half * 8;
    if (key >= p.shape.seqlen) continue;
    float* dkr = p.dk_part + (part + key) * kD;
    float* dvr = p.dv_part + (part + key) * kD;
#pragma unroll
    for (int nt = 0; nt < kD / 8; ++nt) {
      const int c = nt * 8 + 2 * (lane % 4);
      *reinterpret_cast<float2*>(dkr + c) =
          make_float2(dk[nt][2 * half] * p.shape.scale, dk[nt][2 * half + 1] * p.shape.scale);
      *reinterpret_cast<float2*>(dvr + c) = make_float2(dv[nt][2 * half], dv[nt][2 * half + 1]);
    }
  }
  for (int e = tid; e < keys_valid * kDp; e += kKvThreads)
    p.dkp_part[(part + key_base) * kDp + e] = sdKp[e] * (p.shape.proxy_scale * wscale);
}

// ---- 4. fixed-order reduction of the partials into dk, dv, dkp ----

template <class T>
__device__ __forceinline__ void reduce_row(T* dst, const float* part, int64_t part_stride,
                                           int first, int count, int chunk) {
  float acc[8] = {};
  for (int q = first; q < first + count; ++q) {
    const float* src = part + q * part_stride + chunk * 8;
    const float4 lo = *reinterpret_cast<const float4*>(src);
    const float4 hi = *reinterpret_cast<const float4*>(src + 4);
    acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
    acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
  }
  const uint4 out = make_uint4(Elem<T>::pack(acc[0], acc[1]), Elem<T>::pack(acc[2], acc[3]),
                               Elem<T>::pack(acc[4], acc[5]), Elem<T>::pack(acc[6], acc[7]));
  *reinterpret_cast<uint4*>(dst + chunk * 8) = out;
}

template <class T, int kD, int kDp>
__global__ void reduce_kernel(const BackwardKernelParams p) {
  constexpr int kC = kD / 8, kPC = kDp / 8;
  const int kv_heads = p.shape.heads / p.shape.kv_group;
  const int proxy_kv_heads = p.shape.proxy_heads / p.shape.proxy_group;
  const int64_t S = p.shape.seqlen;
  const int64_t main_items = int64_t(p.shape.batch) * kv_heads * S * kC;
  const int64_t proxy_items = int64_t(p.shape.batch) * proxy_kv_heads * S * kPC;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int per_kv = p.shape.proxy_heads / kv_heads;
  for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < main_items + proxy_items;
       x += stride) {
    if (x < main_items) {
      const int chunk = static_cast<int>(x % kC);
      const int64_t s = (x / kC) % S;
      const int c = static_cast<int>((x / (kC * S)) % kv_heads);
      const int b = static_cast<int>(x / (kC * S * kv_heads));
      const int64_t first = (int64_t(b) * p.shape.proxy_heads + c * per_kv) * S + s;
      reduce_row(
          static_cast<T*>(p.dk.data) + b * p.dk.stride_b + c * p.dk.stride_h + s * p.dk.stride_s,
          p.dk_part + first * kD, S * kD, 0, per_kv, chunk);
      reduce_row(
          static_cast<T*>(p.dv.data) + b * p.dv.stride_b + c * p.dv.stride_h + s * p.dv.stride_s,
          p.dv_part + first * kD, S * kD, 0, per_kv, chunk);
    } else {
      const int64_t y = x - main_items;
      const int chunk = static_cast<int>(y % kPC);
      const int64_t s = (y / kPC) % S;
      const int c = static_cast<int>((y / (kPC * S)) % proxy_kv_heads);
      const int b = static_cast<int>(y / (kPC * S * proxy_kv_heads));
      const int64_t first = (int64_t(b) * p.shape.proxy_heads + c * p.shape.proxy_group) * S + s;
      reduce_row(static_cast<T*>(p.dkp.data) + b * p.dkp.stride_b + c * p.dkp.stride_h +
                     s * p.dkp.stride_s,
                 p.dkp_part + first * kDp, S * kDp, 0, p.shape.proxy_group, chunk);
    }
  }
}

}  // namespace flash_msa::cuda::portable::backward
