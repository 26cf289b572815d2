// Hopper (wgmma) dense backward of warmup mode (SPEC sections 3 to 5 with T(p, i) = every visible
// key): the main gradients of the G heads of a proxy group, the teacher, the KL terms and the
// proxy gradients, in one key-outer pass.
//
// One CTA takes key block n of proxy head p (of batch row b) and keeps K_n, V_n and Kp_n in
// shared memory; its two warpgroups split the block's keys (warpgroup w owns keys 64 w ..
// 64 w + 63 and their dK, dV in registers, 2 x 64 fp32 per thread). It walks the query chunks
// of 64 that see the block (from the block on to the end of the documents it overlaps), last
// chunk first, and in each chunk the G heads and then the proxy head, one 64-row tile each
// (Q, dO and the rows' lse, Delta double-buffered, the next tile's gather in flight, issued
// by warpgroup 1):
//   head h:  S = Q K_w^T, dP = dO V_w^T      (m64n64k16 from shared memory)
//            P = exp2(S scale log2e - lse log2e), dS = P (dP - Delta), both to shared memory in
//            the dtype; P also added in fp32 to the chunk's teacher sum (shared memory, each
//            thread its own entries)
//            dV_w += P_w^T dO, dK_w += dS_w^T Q  (m64n128k16, P^T, dS^T read MN-major)
//            dQ[:, 64 w ..] = dS K[:, 64 w ..]    (fp32, added into a zeroed accumulator)
//   proxy:   Sp = Qp Kp_w^T, pp = exp2(Sp ps log2e - lse_p log2e), t = teacher sum / G,
//            g = w (pp - t) / (B Hp S), the KL terms t (log t - log pp); g to shared memory;
//            dKp_w = g_w^T Qp (added into this CTA's fp32 rows), dQp[:, 64 w ..] += g Kp
// so the teacher never leaves the CTA and nothing quadratic is stored.
//
// dQ and dQp leave the registers through shared memory: the tile's 64 x 128 fp32 terms are
// staged in the P and dS space once the products have read it, and one thread adds them into
// the accumulator with one bulk reduction (cp.reduce.async.bulk, performed by the L2), so the
// warpgroups neither load the accumulator nor wait for the add. The accumulators' rows are
// permuted as the staged rows (column j of row i at j ^ 8 (i % 8): conflict-free staging).
//
// Determinism: dQ and dQp of a chunk collect one term per key block; the terms are added in
// the order of the blocks. A counter per (chunk, head or proxy) counts the blocks done: the
// CTA of block n issues its add once the counter reaches n - (the first block the chunk sees),
// and counts itself when the add is complete: thread 0 waits for that two tiles later, during
// the first products, then fences and increments. CTAs take their (n, b, p) from an atomic
// ticket in block order, so a CTA only ever waits for CTAs that already run; and because every
// CTA walks the chunks last first, the CTA of block n trails the one of block n - 1 by about
// two tiles, instead of waiting for it to reach the chunk. dK, dV, dKp and the KL terms are
// per CTA, written once (dKp rows added per chunk by the thread that owns them) and reduced in
// a fixed order afterwards.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/backward_tile_sm90.cuh"
#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/warmup/sm90/warmup_sm90.h"

namespace flash_msa::cuda::sm90::dense_backward {

using namespace backward_tile;        // kRows (query rows of a tile: a chunk), kKeys, kD = D = Dp
inline constexpr int kThreads = 256;  // two warpgroups
inline constexpr float kLog2e = 1.4426950408889634f;

static_assert(kRows == kDenseChunkRows);

// Byte offsets of the SW128-panel tiles (wgmma_sm90.cuh): K, V, Kp, Q[2] (Qp on proxy tiles),
// dO[2], P (g on proxy tiles), dS (P and dS together also stage a tile's fp32 dQ or dQp
// terms); the fp32 teacher sums; slack to align the start to 1024 bytes.
struct SharedMemory {
  static constexpr int kKv = kKeys * kD * 2;
  static constexpr int kTile = kRows * kD * 2;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKv;
  static constexpr int kKp = kV + kKv;
  static constexpr int kQ = kKp + kKv;
  static constexpr int kDout = kQ + 2 * kTile;
  static constexpr int kP = kDout + 2 * kTile;
  static constexpr int kDs = kP + kRows * kKeys * 2;
  static constexpr int kTeacher = kDs + kRows * kKeys * 2;
  static_assert(kTeacher - kP == kRows * kD * 4);  // the staged dQ
  static constexpr int kBytes = kTeacher + kRows * kKeys * 4 + 1024;
};

__device__ __forceinline__ int load_acquire(const int32_t* at) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(at) : "memory");
  return value;
}

// Bulk reduction: `bytes` (a multiple of 16) of fp32 at shared address src added element-wise
// into global memory at dst, by the L2, in a bulk group of this thread (bulk_commit). bulk_wait:
// at most kPending of this thread's latest groups incomplete (their adds performed);
// bulk_wait_read: at most kPending of them still reading their source.
__device__ __forceinline__ void bulk_add_f32(float* dst, uint32_t src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :
               : "l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Asks the L2 to fetch `bytes` (a multiple of 16) of global memory at src, without waiting.
__device__ __forceinline__ void prefetch_l2(const void* src, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// Orders this thread's global-memory accesses of the generic proxy with those of the bulk
// (async) proxy.
__device__ __forceinline__ void fence_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Writes this warpgroup's m64n64 dQ terms d (d[4 t + 2 h + e]: row 16 warp + 8 h + lane / 4,
// column 64 wg + 8 t + 2 (lane % 4) + e) into the [64, 128] fp32 tile at `tile`, column j of
// row i at j ^ 8 (i % 8): the eight rows of a store fall on distinct banks per half warp.
__device__ __forceinline__ void stage_terms(float* tile, const float (&d)[32], int wg, int warp,
                                            int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int r = 16 * warp + 8 * h + lane / 4;
      *reinterpret_cast<float2*>(tile + r * kD + 64 * wg + 8 * (t ^ (lane / 4)) + 2 * (lane % 4)) =
          make_float2(d[4 * t + 2 * h], d[4 * t + 2 * h + 1]);
    }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) backward_kernel(const DenseBackwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = SharedMemory;
  extern __shared__ unsigned char smem_raw[];
  __shared__ float row_stats[2][2][kRows];  // [tile buffer][lse, Delta][tile row]
  __shared__ float kl_warps[kThreads / 32];
  __shared__ int ticket_s, end_s;
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* s_p = smem + Smem::kP;
  unsigned char* s_ds = smem + Smem::kDs;
  float* teacher = reinterpret_cast<float*>(smem + Smem::kTeacher);
  const KernelShape& sh = p.shape;
  const int wg = warpgroup_index(), warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int chunks = (sh.queries + kRows - 1) / kRows;
  const int slots = sh.group + 1;  // the G heads, then the proxy
  int32_t* const tickets = p.order + int64_t(sh.batch) * sh.proxy_heads * chunks * slots;

  if (threadIdx.x == 0) ticket_s = atomicAdd(tickets, 1);
  __syncthreads();
  const int ticket = ticket_s;
  const int n = ticket / (sh.batch * sh.proxy_heads);
  const int b = (ticket / sh.proxy_heads) % sh.batch, ph = ticket % sh.proxy_heads;
  const int key0 = n * kKeys, key_last = min(key0 + kKeys, sh.seqlen) - 1;
  const int head0 = ph * sh.group, kvh = head0 / sh.kv_group, pkh = ph / sh.proxy_group;
  const int32_t* doc_start = p.doc_start ? p.doc_start + int64_t(b) * sh.seqlen : nullptr;
  auto doc_of = [&](int position) { return doc_start ? __ldg(doc_start + position) : 0; };
  // The queries that see the block: positions from key0 to the end of the last document that
  // overlaps it (the first position whose document starts past the block).
  if (threadIdx.x == 0) {
    int lo = key0, hi = sh.seqlen;
    if (doc_start)
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (__ldg(doc_start + mid) > key_last)
          hi = mid;
        else
          lo = mid + 1;
      }
    end_s = doc_start ? lo : sh.seqlen;
  }

  const T* k = static_cast<const T*>(p.k.data) + b * p.k.stride_b + kvh * p.k.stride_h;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.stride_b + kvh * p.v.stride_h;
  const T* kp = static_cast<const T*>(p.kp.data) + b * p.kp.stride_b + pkh * p.kp.stride_h;
  auto key_row = [&](int r, bool& valid) {
    valid = key0 + r < sh.seqlen;
    return min(key0 + r, sh.seqlen - 1);
  };
  copy_rows_sw128<kKeys, kD, kThreads>(
      smem + Smem::kK, [&](int r, bool& valid) { return k + key_row(r, valid) * p.k.stride_s; },
      threadIdx.x);
  copy_rows_sw128<kKeys, kD, kThreads>(
      smem + Smem::kV, [&](int r, bool& valid) { return v + key_row(r, valid) * p.v.stride_s; },
      threadIdx.x);
  copy_rows_sw128<kKeys, kD, kThreads>(
      smem + Smem::kKp, [&](int r, bool& valid) { return kp + key_row(r, valid) * p.kp.stride_s; },
      threadIdx.x);
  cp_async_commit();
  __syncthreads();  // end_s

  const int q_lo = max(key0, sh.query_offset) - sh.query_offset;
  const int q_hi = min(end_s, sh.query_offset + sh.queries) - sh.query_offset;
  const int c_lo = q_lo / kRows, c_hi = (q_hi - 1) / kRows;
  const int tiles = q_lo < q_hi ? (c_hi - c_lo + 1) * slots : 0;
  auto tile_chunk = [&](int i) { return c_hi - i / slots; };
  auto counter = [&](int c, int slot) {
    return p.order + ((int64_t(b) * sh.proxy_heads + ph) * chunks + c) * slots + slot;
  };

  // Q (Qp), dO, lse (lse_p) and Delta of tile i, into buffer buf; rows past the queries zero.
  // Warpgroup 1 copies (thread 0 issues the bulk adds, and a thread's waits for its copies
  // would also wait for its bulk adds: they share one counter).
  auto load_tile = [&](int i, int buf) {
    if (wg != 1) return;
    const int t = threadIdx.x - 128;
    const int c = tile_chunk(i), slot = i % slots;
    const bool proxy = slot == sh.group;
    const int h = head0 + slot;
    auto row = [&](int r, bool& valid) {
      valid = c * kRows + r < sh.queries;
      return min(c * kRows + r, sh.queries - 1);
    };
    const ConstView qv = proxy ? p.qp : p.q;
    const T* q = static_cast<const T*>(qv.data) + b * qv.stride_b + (proxy ? ph : h) * qv.stride_h;
    copy_rows_sw128<kRows, kD, 128>(
        smem + Smem::kQ + buf * Smem::kTile,
        [&](int r, bool& valid) { return q + row(r, valid) * qv.stride_s; }, t);
    if (!proxy) {
      const T* dout =
          static_cast<const T*>(p.dout.data) + b * p.dout.stride_b + h * p.dout.stride_h;
      copy_rows_sw128<kRows, kD, 128>(
          smem + Smem::kDout + buf * Smem::kTile,
          [&](int r, bool& valid) { return dout + row(r, valid) * p.dout.stride_s; }, t);
    }
    {
      const int r = t % kRows, which = t / kRows;
      bool valid;
      const int qi = row(r, valid);
      const int64_t at =
          (int64_t(b) * (proxy ? sh.proxy_heads : sh.heads) + (proxy ? ph : h)) * sh.queries + qi;
      const float* src = proxy ? p.lse_proxy : (which == 0 ? p.lse : p.delta);
      cp_async_4(&row_stats[buf][which][r], src + at, valid && (which == 0 || !proxy));
    }
    cp_async_commit();
  };
  if (tiles > 0) load_tile(0, 0);

  // dK, dV of key 64 wg + 16 warp + lane / 4 + 8 (e / 2), column 8 t + 2 (lane % 4) + e % 2 in
  // [4 t + e] (the m64n128 accumulator).
  float dk[64], dv[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) dk[j] = dv[j] = 0.f;
  float kl = 0.f;  // this thread's KL terms
  const uint64_t q_desc = sw128_desc(smem_addr(smem + Smem::kQ), 16, 1024);
  const uint64_t do_desc = sw128_desc(smem_addr(smem + Smem::kDout), 16, 1024);
  const uint64_t q_mn_desc = sw128_desc(smem_addr(smem + Smem::kQ), kRows * 128, 1024);
  const uint64_t do_mn_desc = sw128_desc(smem_addr(smem + Smem::kDout), kRows * 128, 1024);
  const uint64_t k_desc = sw128_desc(smem_addr(smem + Smem::kK), 16, 1024);
  const uint64_t v_desc = sw128_desc(smem_addr(smem + Smem::kV), 16, 1024);
  const uint64_t kp_desc = sw128_desc(smem_addr(smem + Smem::kKp), 16, 1024);
  const uint64_t p_desc = sw128_desc(smem_addr(s_p), 16, 1024);
  const uint64_t ds_desc = sw128_desc(smem_addr(s_ds), 16, 1024);
  const float w = p.kl_grad ? __ldg(p.kl_grad) * sh.inv_rows : 0.f;
  const float inv_group = 1.f / sh.group;

  float* const staging = reinterpret_cast<float*>(s_p);  // a tile's dQ (dQp) terms, [64, 128]
  // Tile j's accumulator tile and its bytes.
  auto acc_of = [&](int j) {
    const int c = tile_chunk(j), slot = j % slots;
    return slot == sh.group
               ? p.dqp_acc + ((int64_t(b) * sh.proxy_heads + ph) * sh.queries + c * kRows) * kD
               : p.dq_acc + ((int64_t(b) * sh.heads + head0 + slot) * sh.queries + c * kRows) * kD;
  };
  auto acc_bytes = [&](int j) { return min(kRows, sh.queries - tile_chunk(j) * kRows) * kD * 4; };
  // The accumulator tiles come from the L2 to the bulk adds: thread 0 has the next tile's
  // fetched from memory while this one runs.
  if (threadIdx.x == 0 && tiles > 0) prefetch_l2(acc_of(0), acc_bytes(0));
  // Counts tile j's add (thread 0, once the add is complete).
  auto release = [&](int j) {
    fence_async_global();
    __threadfence();
    atomicAdd(counter(tile_chunk(j), j % slots), 1);
  };

  int lo[2], hi[2];  // this lane's rows' visible columns in the current chunk
  int buf = 0;
  for (int i = 0; i < tiles; ++i, buf ^= 1) {
    const int c = tile_chunk(i), slot = i % slots;
    const bool proxy = slot == sh.group;  // CTA-uniform
    if (wg == 1 || i == 0) cp_async_wait<0>();  // (at i = 0 also K, V, Kp)
    fence_async_shared();
    __syncthreads();  // this tile landed; the last tile's products and staged terms are done
    if (i + 1 < tiles) load_tile(i + 1, buf ^ 1);
    if (threadIdx.x == 0 && i + 1 < tiles) prefetch_l2(acc_of(i + 1), acc_bytes(i + 1));
    const uint32_t tile_offset = buf * Smem::kTile;

    if (slot == 0) {
      // Rows 16 warp + 8 h + lane / 4 of the chunk: their columns 64 wg + 8 c + 2 (lane % 4) + e
      // are visible from 8 c + e = lo[h] to hi[h].
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int qi = c * kRows + 16 * warp + 8 * h + lane / 4;
        const int col0 = key0 + 64 * wg + 2 * (lane % 4);
        lo[h] = INT_MAX;
        hi[h] = INT_MIN;
        if (qi < sh.queries) {
          const int position = sh.query_offset + qi;
          lo[h] = doc_of(position) - col0;
          hi[h] = position - col0;
        }
      }
    }
    float stat[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      stat[h] = row_stats[buf][0][16 * warp + 8 * h + lane / 4];
      delta[h] = row_stats[buf][1][16 * warp + 8 * h + lane / 4];
    }
    float dq[32];
    // Thread 0, while the first products run: counts tile i - 2's add (complete by now) and
    // waits until tile i - 1's add has read the staged terms (P and dS are written next).
    auto settle = [&] {
      if (threadIdx.x != 0 || i == 0) return;
      if (i >= 2) {
        bulk_wait<1>();
        release(i - 2);
      }
      bulk_wait_read<0>();
    };
    // Thread 0, while the last products run: reads this tile's counter early.
    int seen = 0;
    auto peek = [&] {
      if (threadIdx.x == 0) seen = load_acquire(counter(c, slot));
    };
    // The tile's staged dQ (dQp) terms, added by thread 0 when the CTAs of the blocks before
    // this one (from the first block chunk c sees) have counted theirs.
    auto add_dq = [&] {
      fence_async_shared();
      __syncthreads();
      if (threadIdx.x != 0) return;
      const int turn = n - doc_of(sh.query_offset + c * kRows) / kKeys;
      while (seen < turn) seen = load_acquire(counter(c, slot));
      fence_async_global();
      bulk_add_f32(acc_of(i), smem_addr(staging), acc_bytes(i));
      bulk_commit();
    };

    if (!proxy) {
      // S = Q K_w^T and dP = dO V_w^T.
      float s[32], dp[32];
      wgmma_fence();
      issue_scores<T>(s, dp, q_desc, do_desc, k_desc, v_desc, tile_offset, wg);
      wgmma_commit();
      settle();
      wgmma_wait<0>();
      fence_operands(s);
      fence_operands(dp);
      if (i > 0) __syncthreads();  // the staged terms are read

      // P = exp2(S scale log2e - lse log2e), masked to 0 where not visible (most tiles see all
      // 64 keys: no masking then); the teacher sum of the chunk.
      mask_columns(s, lo, hi);
      const float base[2] = {-stat[0] * kLog2e, -stat[1] * kLog2e};
      store_p_ds<T>(s_p, s_ds, s, dp, sh.scale_log2, base, delta, wg, warp, lane,
                    [&](int j, float pr) {
                      float& t = teacher[j * kThreads + threadIdx.x];
                      t = slot == 0 ? pr : t + pr;
                    });
      fence_async_shared();
      __syncthreads();  // both halves of P and dS are in place

      // dV_w += P_w^T dO, dK_w += dS_w^T Q; dQ = dS K[:, 64 wg ..].
      wgmma_fence();
      issue_gradients<T>(dv, dk, dq, p_desc, ds_desc, do_mn_desc, q_mn_desc, k_desc, tile_offset,
                         wg);
      wgmma_commit();
      peek();
      wgmma_wait<0>();
      fence_operands(dk);
      fence_operands(dv);
      fence_operands(dq);
      __syncthreads();  // both warpgroups' products are done with P and dS
      stage_terms(staging, dq, wg, warp, lane);
    } else {
      // The proxy tile: Sp = Qp Kp_w^T, the student, the teacher and g (in P's place).
      float sp[32];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t panel = tile_offset + (kk / 4) * kRows * 128 + (kk % 4) * 32;
        const uint32_t kv_panel = (kk / 4) * kKeys * 128 + 64 * wg * 128 + (kk % 4) * 32;
        wgmma_m64n64k16_ss<T, 0, 0>(sp, desc_add(q_desc, panel), desc_add(kp_desc, kv_panel),
                                    kk > 0);
      }
      wgmma_commit();
      settle();
      wgmma_wait<0>();
      fence_operands(sp);
      if (i > 0) __syncthreads();  // the staged terms are read
      mask_columns(sp, lo, hi);
#pragma unroll
      for (int cc = 0; cc < 8; ++cc)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float g[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 4 * cc + 2 * h + e;
            const float pp = fast_exp2(fmaf(sp[j], sh.proxy_scale_log2, -stat[h] * kLog2e));
            const float t = teacher[j * kThreads + threadIdx.x] * inv_group;
            g[e] = w * (pp - t);
            // t log(t / pp), log pp = Sp proxy_scale - lse_p; t = 0 where pp is masked.
            if (!(t <= 0.f)) kl += t * (__logf(t) - fmaf(sp[j], sh.proxy_scale, -stat[h]));
          }
          const int r = 16 * warp + 8 * h + lane / 4, col = 64 * wg + 8 * cc + 2 * (lane % 4);
          store_pair<T>(s_p, r, col, g[0], g[1]);
        }
      fence_async_shared();
      __syncthreads();  // g is in place

      // The first 64 columns of dKp_w = g_w^T Qp, then the other 64 with dQp = g Kp[:, 64 wg ..]
      // (halves keep dK, dV and these products within the registers); dKp is added into the
      // CTA's rows.
      float dkp[32];
      auto add_dkp = [&](int half) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = 64 * wg + 16 * warp + 8 * h + lane / 4;
          if (key0 + key >= sh.seqlen) continue;
          float* row = p.dkp_part +
                       ((int64_t(b) * sh.proxy_heads + ph) * sh.seqlen + key0 + key) * kD +
                       64 * half + 2 * (lane % 4);
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            float2 acc = *reinterpret_cast<float2*>(row + 8 * t);
            acc.x = fmaf(dkp[4 * t + 2 * h], sh.proxy_scale, acc.x);
            acc.y = fmaf(dkp[4 * t + 2 * h + 1], sh.proxy_scale, acc.y);
            *reinterpret_cast<float2*>(row + 8 * t) = acc;
          }
        }
      };
      auto issue_dkp = [&](int half) {
#pragma unroll
        for (int kk = 0; kk < kRows / 16; ++kk) {
          const uint32_t rows16 = kk * 16 * 128;
          wgmma_m64n64k16_ss<T, 1, 1>(
              dkp, desc_add(p_desc, wg * kRows * 128 + rows16),
              desc_add(q_mn_desc, tile_offset + half * kRows * 128 + rows16), kk > 0);
        }
      };
      wgmma_fence();
      issue_dkp(0);
      wgmma_commit();
      peek();
      wgmma_wait<0>();
      fence_operands(dkp);
      add_dkp(0);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma_m64n64k16_ss<T, 0, 1>(dq, desc_add(p_desc, (kk / 4) * kRows * 128 + (kk % 4) * 32),
                                    desc_add(kp_desc, wg * kKeys * 128 + kk * 16 * 128), kk > 0);
      issue_dkp(1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(dkp);
      fence_operands(dq);
      add_dkp(1);
      __syncthreads();  // both warpgroups' products are done with g
      stage_terms(staging, dq, wg, warp, lane);
    }
    add_dq();
  }
  // The last two tiles' adds, once complete.
  if (threadIdx.x == 0 && tiles > 0) {
    bulk_wait<0>();
    if (tiles > 1) release(tiles - 2);
    release(tiles - 1);
  }

  // This CTA's dK (scaled), dV rows, and the sum of its KL terms in a fixed order.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = 64 * wg + 16 * warp + 8 * h + lane / 4;
    if (key0 + key >= sh.seqlen) continue;
    const int64_t at =
        ((int64_t(b) * sh.proxy_heads + ph) * sh.seqlen + key0 + key) * kD + 2 * (lane % 4);
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      *reinterpret_cast<float2*>(p.dk_part + at + 8 * t) =
          make_float2(dk[4 * t + 2 * h] * sh.scale, dk[4 * t + 2 * h + 1] * sh.scale);
      *reinterpret_cast<float2*>(p.dv_part + at + 8 * t) =
          make_float2(dv[4 * t + 2 * h], dv[4 * t + 2 * h + 1]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) kl += __shfl_xor_sync(~0u, kl, off);
  if (lane == 0) kl_warps[threadIdx.x / 32] = kl;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int x = 0; x < kThreads / 32; ++x) sum += kl_warps[x];
    p.kl_part[(int64_t(b) * sh.proxy_heads + ph) * sh.num_blocks + n] = sum;
  }
#else
  __trap();  // built without sm_90a code: warmup_kernels() never picks it then
#endif
}

}  // namespace flash_msa::cuda::sm90::dense_backward

namespace flash_msa::cuda::sm90 {

template <class T>
void launch_dense_backward(const DenseBackwardParams& params, cudaStream_t stream) {
  using namespace dense_backward;
  const auto& sh = params.shape;
  launch_large_smem(backward_kernel<T>,
                    static_cast<unsigned>(sh.batch * sh.proxy_heads * sh.num_blocks), kThreads,
                    SharedMemory::kBytes, params, stream);
}

}  // namespace flash_msa::cuda::sm90
