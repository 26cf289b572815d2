// Hopper (wgmma) dense forward of warmup mode (SPEC sections 2, 3 and 5 with T(p, i) = every
// visible key): out and lse of each main head, and lse_p of each proxy head, query-outer.
//
// One CTA takes 128 queries of one head (blockIdx.y < H: main head; >= H: proxy head, which
// only needs its log-sum-exp) and walks the key blocks of 128 from the block of its first
// query's document start to its last query's block, K (and V) double-buffered in shared memory
// (cp.async by all 256 threads, the next block's copy in flight during this one's products).
// Each of the two warpgroups owns 64 query rows: S = Q K^T (eight m64n128k16 wgmma from shared
// memory, fp32), masked to the visible keys [doc start, query] only in the blocks that need it,
// an online softmax in log2 units (row maxima over the lane quad, row sums per thread until the
// end), O rescaled, and O += P V with P rounded to the dtype in registers (m64n64k16 per
// 64-column panel of V, read MN-major). The query tiles go out longest first (the last queries
// see the most keys), so the short ones fill the tail.
//
// The forward's KL value is not computed here: the backward's pass has the teacher at hand and
// gives it (warmup/warmup.cu runs the portable forward when a caller asks for it in the forward).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/warmup/sm90/warmup_sm90.h"

namespace flash_msa::cuda::sm90::dense_forward {

inline constexpr int kWarpgroups = 2;
inline constexpr int kThreads = 128 * kWarpgroups;
inline constexpr int kRows = 64;                       // query rows of a warpgroup
inline constexpr int kTileRows = kRows * kWarpgroups;  // query rows of a CTA
inline constexpr int kKeys = 128;                      // keys of a block
inline constexpr int kD = 128;                         // D = Dp (two 64-column panels)
inline constexpr float kLn2 = 0.6931471805599453f;

// SW128-panel tiles (wgmma_sm90.cuh): each warpgroup's Q rows, and two stages of K and V; plus
// slack to align the start to 1024 bytes.
struct SharedMemory {
  static constexpr int kQTile = kRows * kD * 2;
  static constexpr int kKvTile = kKeys * kD * 2;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kWarpgroups * kQTile;
  static constexpr int kV = kK + 2 * kKvTile;
  static constexpr int kBytes = kV + 2 * kKvTile + 1024;
};

template <class T>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel(const DenseForwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = SharedMemory;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  const KernelShape& sh = p.shape;
  const int tiles = (sh.queries + kTileRows - 1) / kTileRows;
  const int q_begin = (tiles - 1 - static_cast<int>(blockIdx.x)) * kTileRows;
  const int b = blockIdx.z, head = blockIdx.y;
  const bool proxy = head >= sh.heads;  // CTA-uniform
  const int wg = warpgroup_index(), wt = threadIdx.x % 128;
  const int warp = wt / 32, lane = threadIdx.x % 32;

  const ConstView qv = proxy ? p.qp : p.q;
  const ConstView kv = proxy ? p.kp : p.k;
  const int q_head = proxy ? head - sh.heads : head;
  const int k_head = proxy ? q_head / sh.proxy_group : head / sh.kv_group;
  const T* q = static_cast<const T*>(qv.data) + b * qv.stride_b + q_head * qv.stride_h;
  const T* k = static_cast<const T*>(kv.data) + b * kv.stride_b + k_head * kv.stride_h;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.stride_b + k_head * p.v.stride_h;
  const float scale_log2 = proxy ? sh.proxy_scale_log2 : sh.scale_log2;
  const int32_t* doc_start = p.doc_start ? p.doc_start + int64_t(b) * sh.seqlen : nullptr;
  auto doc_of = [&](int position) { return doc_start ? __ldg(doc_start + position) : 0; };

  const int q_last = min(q_begin + kTileRows, sh.queries) - 1;
  const int first_block = doc_of(sh.query_offset + q_begin) / kKeys;
  const int last_block = (sh.query_offset + q_last) / kKeys;

  unsigned char* s_q = smem + Smem::kQ + wg * Smem::kQTile;
  copy_rows_sw128<kRows, kD, 128>(
      s_q,
      [&](int r, bool& valid) {
        const int qi = q_begin + kRows * wg + r;
        valid = qi < sh.queries;
        return q + min(qi, sh.queries - 1) * qv.stride_s;
      },
      wt);
  // Keys past the sequence: zeros (their address clamped to the last key).
  auto load_block = [&](int n, int stage) {
    auto key_row = [&](int r, bool& valid) {
      valid = n * kKeys + r < sh.seqlen;
      return min(n * kKeys + r, sh.seqlen - 1);
    };
    copy_rows_sw128<kKeys, kD, kThreads>(
        smem + Smem::kK + stage * Smem::kKvTile,
        [&](int r, bool& valid) { return k + key_row(r, valid) * kv.stride_s; }, threadIdx.x);
    if (!proxy)
      copy_rows_sw128<kKeys, kD, kThreads>(
          smem + Smem::kV + stage * Smem::kKvTile,
          [&](int r, bool& valid) { return v + key_row(r, valid) * p.v.stride_s; }, threadIdx.x);
  };
  load_block(first_block, 0);
  cp_async_commit();

  // This lane's rows 16 warp + 8 h + lane / 4 of the warpgroup's tile: query index, position
  // and document start (rows past the queries see nothing).
  int qi[2], position[2], first[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    qi[h] = q_begin + kRows * wg + 16 * warp + 8 * h + lane / 4;
    position[h] = sh.query_offset + min(qi[h], sh.queries - 1);
    first[h] = qi[h] < sh.queries ? doc_of(position[h]) : INT_MAX;
    if (qi[h] >= sh.queries) position[h] = INT_MIN;
  }

  const uint64_t q_desc = sw128_desc(smem_addr(s_q), 16, 1024);
  float o[2][32];
#pragma unroll
  for (int j = 0; j < 32; ++j) o[0][j] = o[1][j] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // row maxima of scale * log2(e) * S so far
  float l[2] = {0.f, 0.f};              // this thread's part of the row sums

  for (int n = first_block; n <= last_block; ++n) {
    const int stage = (n - first_block) % 2;
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // block n landed; every warpgroup is done with the other stage
    if (n < last_block) load_block(n + 1, stage ^ 1);
    cp_async_commit();

    float s[64];
    const uint64_t k_desc =
        sw128_desc(smem_addr(smem + Smem::kK + stage * Smem::kKvTile), 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t offset = (kk % 4) * 32;  // bytes into the panel's 128-byte rows
      wgmma_m64n128k16_ss<T, 0, 0>(s, desc_add(q_desc, (kk / 4) * kRows * 128 + offset),
                                   desc_add(k_desc, (kk / 4) * kKeys * 128 + offset), kk > 0);
    }
    wgmma_commit();
    int lo[2], hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col0 = n * kKeys + 2 * (lane % 4);
      lo[h] = first[h] == INT_MAX ? INT_MAX : first[h] - col0;
      hi[h] = position[h] == INT_MIN ? INT_MIN : position[h] - col0;
    }
    wgmma_wait<0>();
    fence_operands(s);
    mask_columns(s, lo, hi);

    // Online softmax: new row maxima (four independent chains per row), the rescale factor of
    // what came before, and P = exp2(S scale log2e - m) in place.
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mc[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int c = 0; c < 16; ++c)
        mc[c % 4] = fmaxf(mc[c % 4], fmaxf(s[4 * c + 2 * h], s[4 * c + 2 * h + 1]));
      const float mx = quad_max(fmaxf(fmaxf(mc[0], mc[1]), fmaxf(mc[2], mc[3])));
      const float m_new = fmaxf(m[h], mx * scale_log2);
      // A row with no visible key so far keeps m = -inf: subtract 0 then, not -inf.
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = fast_exp2(m[h] - base);
      m[h] = m_new;
      float lc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        s[4 * c + 2 * h] = fast_exp2(fmaf(s[4 * c + 2 * h], scale_log2, -base));
        s[4 * c + 2 * h + 1] = fast_exp2(fmaf(s[4 * c + 2 * h + 1], scale_log2, -base));
        lc[c % 4] += s[4 * c + 2 * h] + s[4 * c + 2 * h + 1];
      }
      l[h] = fmaf(l[h], alpha[h], (lc[0] + lc[1]) + (lc[2] + lc[3]));
    }
    if (proxy) continue;  // CTA-uniform: the proxy branch needs only lse

#pragma unroll
    for (int panel = 0; panel < 2; ++panel)
#pragma unroll
      for (int j = 0; j < 32; ++j) o[panel][j] *= alpha[(j % 4) / 2];
    uint32_t a[kKeys / 16][4];
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const float(&lo4)[4] = *reinterpret_cast<const float(*)[4]>(s + 8 * kk);
      const float(&hi4)[4] = *reinterpret_cast<const float(*)[4]>(s + 8 * kk + 4);
      portable::acc_to_a<T>(a[kk], lo4, hi4);
    }
    const uint64_t v_desc =
        sw128_desc(smem_addr(smem + Smem::kV + stage * Smem::kKvTile), kKeys * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int panel = 0; panel < 2; ++panel)
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma_m64n64k16_rs_mn<T>(o[panel], a[kk],
                                 desc_add(v_desc, panel * kKeys * 128 + kk * 16 * 128), true);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(o[0]);
    fence_operands(o[1]);
    fence_operands(a);
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(l[h]);
    if (qi[h] >= sh.queries) continue;
    const int bh = b * (proxy ? sh.proxy_heads : sh.heads) + q_head;
    const float lse = sum > 0.f ? (m[h] + fast_log2(sum)) * kLn2 : -INFINITY;
    if (lane % 4 == 0) (proxy ? p.lse_proxy : p.lse)[sh.query_row(bh, position[h])] = lse;
    if (proxy) continue;
    const float inv = sum > 0.f ? fast_rcp(sum) : 0.f;
    T* row = static_cast<T*>(p.out.data) + b * p.out.stride_b + head * p.out.stride_h +
             int64_t(qi[h]) * p.out.stride_s;
#pragma unroll
    for (int panel = 0; panel < 2; ++panel)
#pragma unroll
      for (int t = 0; t < 8; ++t)
        *reinterpret_cast<uint32_t*>(row + 64 * panel + 8 * t + 2 * (lane % 4)) =
            Elem<T>::pack(o[panel][4 * t + 2 * h] * inv, o[panel][4 * t + 2 * h + 1] * inv);
  }
#else
  __trap();  // built without sm_90a code: warmup_kernels() never picks it then
#endif
}

}  // namespace flash_msa::cuda::sm90::dense_forward

namespace flash_msa::cuda::sm90 {

template <class T>
void launch_dense_forward(const DenseForwardParams& params, cudaStream_t stream) {
  using namespace dense_forward;
  const auto& sh = params.shape;
  const dim3 grid((sh.queries + kTileRows - 1) / kTileRows, sh.heads + sh.proxy_heads, sh.batch);
  FLASH_MSA_CUDA_CHECK(cudaFuncSetAttribute(
      forward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, SharedMemory::kBytes));
  forward_kernel<T><<<grid, kThreads, SharedMemory::kBytes, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::sm90
