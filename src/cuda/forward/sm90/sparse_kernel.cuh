// Hopper (wgmma) sparse main-attention forward of MSA (SPEC section 2), key-block-outer like
// the portable kernel (forward/portable/sparse_kernel.cuh, which explains the choice), with the
// same work items and the same partial results, so the merge is shared.
//
// One CTA takes a work item (up to 256 tokens that selected key block n of proxy head p): all
// 256 threads load K_n and V_n into shared memory once, and the item's entries decoded (token,
// document start, edge; schedule::ItemRows), so that no global load stands between a tile and
// its gather; then each of the two warpgroups walks its own query tiles of 64 rows
// (floor(64 / G) tokens x G heads; tiles wg, wg + 2, ...) through three shared buffers, the
// gather (cp.async) of the tile after next in flight. The warpgroups take turns to issue their
// tensor-core work, S = Q K^T of the next tile together with O = P V of the current one; each
// then runs the next tile's softmax and the current tile's stores while the tensor cores work
// on its own P V and on the other warpgroup's products.
//
// Per tile: S = Q K^T as eight m64n128k16 wgmma from shared memory (fp32, 64 registers); the
// block has only 128 keys, so the softmax is one pass (row max, exp2 of log2(e)-prescaled
// scores, row sum), no rescaling; P, rounded to the input dtype, stays in registers as the A
// operand of O = P V (m64n64k16 per 64 columns of V, V read MN-major), one commit group per
// 64-column panel, so that the first panel's partial rows go out (in fragment order,
// mma_sm80.cuh) while the tensor cores compute the second.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/forward/sm90/sparse_sm90.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::sm90::sparse_forward {

inline constexpr int kWarpgroups = 2;
inline constexpr int kThreads = 128 * kWarpgroups;
inline constexpr int kRows = 64;     // rows of a warpgroup's query tile
inline constexpr int kKeys = 128;    // keys of a block
inline constexpr int kD = 128;       // head dim (two 64-column panels)
inline constexpr int kQBuffers = 3;  // query tiles per warpgroup in shared memory

// K, V of the block, kQBuffers query tiles per warpgroup and, with the proxy branch, the block's
// proxy keys Kp, SW128 panels (wgmma_sm90.cuh), plus slack to align the start to 1024 bytes.
template <bool kProxy>
struct SharedMemory {
  static constexpr int kKvBytes = kKeys * kD * 2;
  static constexpr int kQBytes = kRows * kD * 2;
  static constexpr int kBytes =
      (kProxy ? 3 : 2) * kKvBytes + kQBuffers * kWarpgroups * kQBytes + 1024;
};

// kProxy (Dp = 128): the CTA also computes the proxy branch's per-edge lse of its item
// (SPEC section 3, as the proxy kernel's kLse pass): after its query tiles each warpgroup takes
// 64-token tiles of proxy queries (one row per token), S_p = Qp Kp^T, and the log-sum-exp of
// the row's visible scores.
template <class T, bool kProxy>
__global__ void __launch_bounds__(kThreads, 1)
    forward_kernel(const portable::SparseForwardParams p) {
  using Smem = SharedMemory<kProxy>;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  __shared__ schedule::ItemRows rows;
  __shared__ schedule::TileRows<kRows> tile_rows;
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* s_k = smem;
  unsigned char* s_v = s_k + Smem::kKvBytes;
  unsigned char* s_q = s_v + Smem::kKvBytes;
  unsigned char* s_kp = s_q + kQBuffers * kWarpgroups * Smem::kQBytes;  // kProxy

  schedule::Item item;
  if (!schedule::find_item(p.items, p.shape, blockIdx.x, item)) return;
  const int wg = warpgroup_index(), wt = threadIdx.x % 128;
  const int warp = wt / 32, lane = threadIdx.x % 32;
  const int b = item.b, ph = item.ph, head0 = item.head0, key0 = item.key0;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.stride_b +
               (head0 / p.shape.kv_group) * p.k.stride_h;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.stride_b +
               (head0 / p.shape.kv_group) * p.v.stride_h;
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.stride_b + head0 * p.q.stride_h;

  // Keys past the sequence: zeros (their address clamped to the last key).
  auto key_row = [&](int r, bool& valid) {
    valid = key0 + r < p.shape.seqlen;
    return min(key0 + r, p.shape.seqlen - 1);
  };
  copy_rows_sw128<kKeys, kD, kThreads>(
      s_k, [&](int r, bool& valid) { return k + key_row(r, valid) * p.k.stride_s; }, threadIdx.x);
  copy_rows_sw128<kKeys, kD, kThreads>(
      s_v, [&](int r, bool& valid) { return v + key_row(r, valid) * p.v.stride_s; }, threadIdx.x);
  if constexpr (kProxy) {
    const T* kp = static_cast<const T*>(p.kp.data) + b * p.kp.stride_b +
                  (ph / p.shape.proxy_group) * p.kp.stride_h;
    copy_rows_sw128<kKeys, kD, kThreads>(
        s_kp, [&](int r, bool& valid) { return kp + key_row(r, valid) * p.kp.stride_s; },
        threadIdx.x);
  }
  cp_async_commit();
  schedule::load_item_rows<kThreads>(rows, item, p, threadIdx.x);
  schedule::fill_tile_rows<kRows, kThreads>(tile_rows, p.shape.group, threadIdx.x);
  __syncthreads();  // the item's and the tile's rows are in place

  const int item_rows = item.end - item.begin;
  const int tile_tokens = kRows / p.shape.group;
  const int tiles = (item_rows + tile_tokens - 1) / tile_tokens;
  // Tile i of this warpgroup is item tile wg + 2 i, in buffer i % 3. Every load commits one
  // cp.async group, empty past the last tile, so that "all but the newest group" is always the
  // tile needed next.
  auto tiles_of = [&](int w) {
    return w < tiles ? (tiles - w + kWarpgroups - 1) / kWarpgroups : 0;
  };
  const int my_tiles = tiles_of(wg);
  // With the proxy branch, the warpgroup's proxy tiles j (64 tokens, one row each, from item row
  // proxy_row0(j)) follow its query tiles through the same buffers, tile my_tiles + j, so that
  // their loads too are in flight two tiles ahead.
  auto proxy_row0 = [&](int j) { return kRows * (wg + kWarpgroups * j); };
  const int my_proxy_tiles =
      kProxy && item_rows > kRows * wg ? (item_rows - kRows * wg + 2 * kRows - 1) / (2 * kRows) : 0;
  auto q_buffer = [&](int i) { return s_q + (kQBuffers * wg + i % kQBuffers) * Smem::kQBytes; };
  auto load_q = [&](int i) {
    if (i < my_tiles) {
      const int t0 = (wg + kWarpgroups * i) * tile_tokens;
      copy_rows_sw128<kRows, kD, 128>(
          q_buffer(i),
          [&](int r, bool& valid) {
            return q + tile_rows.row[r].head * p.q.stride_h +
                   p.shape.query_at(tile_rows.token_of(rows, t0, r, item_rows, valid)) *
                       p.q.stride_s;
          },
          wt);
    } else if (i - my_tiles < my_proxy_tiles) {
      const T* qp = static_cast<const T*>(p.qp.data) + b * p.qp.stride_b + ph * p.qp.stride_h;
      const int t0 = proxy_row0(i - my_tiles);
      copy_rows_sw128<kRows, kD, 128>(
          q_buffer(i),
          [&](int r, bool& valid) {
            valid = t0 + r < item_rows;
            return qp + p.shape.query_at(rows.token[min(t0 + r, item_rows - 1)]) * p.qp.stride_s;
          },
          wt);
    }
    cp_async_commit();
  };
  const uint64_t k_desc = sw128_desc(smem_addr(s_k), 16, 1024);
  const uint64_t v_desc = sw128_desc(smem_addr(s_v), kKeys * 128, 1024);
  // S = Q K^T of the query tile at `tile` over the block's 128 keys at `keys`; K-steps of 16
  // columns, 4 per 64-column panel.
  auto issue_product = [&](float(&acc)[64], const unsigned char* tile, uint64_t keys) {
    const uint64_t q_desc = sw128_desc(smem_addr(tile), 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t offset = (kk % 4) * 32;  // bytes into the panel's 128-byte rows
      wgmma_m64n128k16_ss<T, 0, 0>(acc, desc_add(q_desc, (kk / 4) * kRows * 128 + offset),
                                   desc_add(keys, (kk / 4) * kKeys * 128 + offset), kk > 0);
    }
    wgmma_commit();
  };
  auto issue_scores = [&](float(&acc)[64], int i) { issue_product(acc, q_buffer(i), k_desc); };
  // This lane's rows of a tile are 16 warp + 8 h + lane / 4 (h = 0, 1); row h at item row t[h]
  // has visible columns 8 c + 2 (lane % 4) + e from lo[h] to hi[h] of 8 c + e (causal and
  // document bounds), everything past the item (nothing is stored there).
  auto visible_columns = [&](const int(&t)[2], int(&lo)[2], int(&hi)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lo[h] = INT_MIN;
      hi[h] = INT_MAX;
      if (t[h] < item_rows) {
        lo[h] = rows.first[t[h]] - key0 - 2 * (lane % 4);
        hi[h] = rows.token[t[h]] - key0 - 2 * (lane % 4);
      }
    }
  };
  // One-pass softmax of the scores s (unscaled; scale > 0 keeps the maximum), masked to the
  // visible columns: s becomes exp2(s scale - m), m the row maximum in log2 units, l the row sum.
  auto softmax = [&](float(&s)[64], const int(&lo)[2], const int(&hi)[2], float scale, float(&m)[2],
                     float(&l)[2]) {
    // Most tiles see every key of the block: no masking then.
    mask_columns(s, lo, hi);
    // Maxima and sums in four independent chains per row (a row's 32 values in one chain of
    // dependent instructions would stall on each), combined at the end.
    float mc[2][4], lc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        mc[h][x] = -INFINITY;
        lc[h][x] = 0.f;
      }
#pragma unroll
    for (int j = 0; j < 64; ++j)
      mc[(j % 4) / 2][(j / 4) % 4] = fmaxf(mc[(j % 4) / 2][(j / 4) % 4], s[j]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[h] = quad_max(fmaxf(fmaxf(mc[h][0], mc[h][1]), fmaxf(mc[h][2], mc[h][3])));
      // A row with no visible key keeps m = -inf: subtract 0 then, not -inf.
      m[h] = m[h] == -INFINITY ? 0.f : m[h] * scale;
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        s[4 * c + 2 * h] = fast_exp2(fmaf(s[4 * c + 2 * h], scale, -m[h]));
        s[4 * c + 2 * h + 1] = fast_exp2(fmaf(s[4 * c + 2 * h + 1], scale, -m[h]));
        lc[h][c % 4] += s[4 * c + 2 * h] + s[4 * c + 2 * h + 1];
      }
      l[h] = quad_sum((lc[h][0] + lc[h][1]) + (lc[h][2] + lc[h][3]));
    }
  };
  auto lse_of = [](float m, float l) { return l > 0.f ? m + fast_log2(l) : -INFINITY; };

  // This lane's rows of tile i: item rows t[h].
  auto rows_of = [&](int i, int(&t)[2]) {
    const int t0 = (wg + kWarpgroups * i) * tile_tokens;  // item row of the tile's first token
#pragma unroll
    for (int h = 0; h < 2; ++h) t[h] = t0 + tile_rows.row[16 * warp + 8 * h + lane / 4].token;
  };
  // P (keys 16 kk ..) rounded to the input dtype as the A registers of O = P V.
  auto to_a = [](const float(&s)[64], uint32_t(&a)[kKeys / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const float(&lo)[4] = *reinterpret_cast<const float(*)[4]>(s + 8 * kk);
      const float(&hi)[4] = *reinterpret_cast<const float(*)[4]>(s + 8 * kk + 4);
      portable::acc_to_a<T>(a[kk], lo, hi);
    }
  };
  // The two warpgroups take turns to issue their products (S of the next tile, then P V of
  // this one), warpgroup 0 first, on named barriers kTurnBarrier + wg (bar.sync by the warpgroup
  // whose turn it is, bar.arrive by the other): each one's softmax and stores then run while the
  // tensor cores work on the other's products. A warpgroup arrives only for a turn the other
  // still has, so no arrival is left over.
  const int other_tiles = tiles_of(1 - wg);
  auto wait_turn = [&] { named_barrier_sync(kTurnBarrier + wg, 2 * 128); };
  auto pass_turn = [&] { named_barrier_arrive(kTurnBarrier + (1 - wg), 2 * 128); };

  load_q(0);
  load_q(1);
  cp_async_wait<1>();
  fence_async_shared();
  __syncthreads();                              // K, V and each warpgroup's first tile are in place
  if (wg == 1 && other_tiles > 0) pass_turn();  // warpgroup 0 takes the first turn
  if (my_tiles == 0) return;

  // Tile 0's S and softmax, then per tile i: the products (S of tile i + 1 into s, O = P V of
  // tile i from a), the softmax of tile i + 1 while P V runs, the stores of tile i.
  float s[64];
  uint32_t a[kKeys / 16][4];
  float m[2], l[2];  // tile i's row maxima (log2 units) and sums
  int t[2];          // tile i's item rows
  {
    issue_scores(s, 0);
    int lo[2], hi[2];
    rows_of(0, t);
    visible_columns(t, lo, hi);
    wgmma_wait<0>();
    fence_operands(s);
    softmax(s, lo, hi, p.shape.scale_log2, m, l);
    to_a(s, a);
  }
  int i = 0;
  do {
    // Buffer (i + 2) % 3 held tile i - 1, whose S every warp finished before the last turn.
    load_q(i + 2);
    cp_async_wait<1>();
    fence_async_shared();
    wait_turn();  // also: tile i + 1 landed (every warp of the warpgroup is at the barrier)
    // After the last tile this recomputes the current one, unused: an unconditional issue
    // keeps branches away from the products in flight (the compiler would wait first).
    issue_scores(s, min(i + 1, my_tiles - 1));
    // O = P V: V's rows are keys, MN-major, one wgmma and commit group per 64-column panel.
    float o[2][32];
    wgmma_fence();
#pragma unroll
    for (int panel = 0; panel < 2; ++panel) {
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma_m64n64k16_rs_mn<T>(o[panel], a[kk],
                                 desc_add(v_desc, panel * kKeys * 128 + kk * 16 * 128), kk > 0);
      wgmma_commit();
    }
    if (wg == 0 ? i < other_tiles : i + 1 < other_tiles) pass_turn();

    int t_next[2], lo[2], hi[2];
    rows_of(i + 1, t_next);
    visible_columns(t_next, lo, hi);
    wgmma_wait<2>();  // S of tile i + 1
    fence_operands(s);
    float m_next[2], l_next[2];
    softmax(s, lo, hi, p.shape.scale_log2, m_next, l_next);
    // The softmax before the waits below: its results are used only after them, and ptxas
    // moves a wait up to the start of its basic block, so these fences and the branches of the
    // row code next keep the softmax in a block of its own.
    fence_operands(s);
    fence_operands(m_next);
    fence_operands(l_next);

    // Tile i's rows: partial row (row of o_part), 1 / l, lse.
    int64_t row[2];
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (t[h] >= item_rows) continue;
      row[h] = rows.edge[t[h]] * p.shape.group + tile_rows.row[16 * warp + 8 * h + lane / 4].head;
      inv[h] = l[h] > 0.f ? fast_rcp(l[h]) : 0.f;
      if (lane % 4 == 0) p.lse_part[row[h]] = lse_of(m[h], l[h]);
    }
    // Tile i's 64-column panels of O, the first while the second is on the tensor cores.
    auto store_panel = [&](int panel) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (t[h] >= item_rows) continue;
        uint32_t packed[kD / 16];
#pragma unroll
        for (int t = 0; t < kD / 16; ++t)
          packed[t] =
              Elem<T>::pack(o[panel][4 * t + 2 * h] * inv[h], o[panel][4 * t + 2 * h + 1] * inv[h]);
        store_fragment_row<kD / 16, 1>(static_cast<T*>(p.o_part) + row[h] * kD, lane % 4,
                                       panel * kD / 16, packed);
      }
    };
    wgmma_wait<1>();
    fence_operands(o[0]);
    store_panel(0);
    wgmma_wait<0>();
    fence_operands(o[1]);
    fence_operands(a);
    store_panel(1);
    to_a(s, a);  // P V of tile i is done with a
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[h] = m_next[h];
      l[h] = l_next[h];
      t[h] = t_next[h];
    }
  } while (++i < my_tiles);

  // The proxy tiles, loaded by the last two query tiles' iterations (groups my_tiles and
  // my_tiles + 1 are the newest).
  if constexpr (kProxy) {
    const uint64_t kp_desc = sw128_desc(smem_addr(s_kp), 16, 1024);
    for (int j = 0; j < my_proxy_tiles; ++j) {
      if (j == 0)
        cp_async_wait<1>();
      else
        cp_async_wait<0>();
      fence_async_shared();
      warpgroup_sync(wg);  // the tile's Qp rows are in place
      issue_product(s, q_buffer(my_tiles + j), kp_desc);
      const int t0 = proxy_row0(j);
      int t[2], lo[2], hi[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) t[h] = t0 + 16 * warp + 8 * h + lane / 4;
      visible_columns(t, lo, hi);
      wgmma_wait<0>();
      fence_operands(s);
      float m[2], l[2];
      softmax(s, lo, hi, p.shape.proxy_scale_log2, m, l);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (t[h] < item_rows && lane % 4 == 0) p.lse_p_part[rows.edge[t[h]]] = lse_of(m[h], l[h]);
    }
  }
#else
  __trap();  // built without sm_90a code: sparse_kernels() never picks it then
#endif
}

}  // namespace flash_msa::cuda::sm90::sparse_forward

namespace flash_msa::cuda::sm90 {

template <class T>
void launch_sparse_forward(const portable::SparseForwardParams& params, cudaStream_t stream) {
  using namespace sparse_forward;
  const unsigned grid = static_cast<unsigned>(params.items.max_items);
  if (params.lse_p_part != nullptr)
    launch_large_smem(forward_kernel<T, true>, grid, kThreads, SharedMemory<true>::kBytes, params,
                      stream);
  else
    launch_large_smem(forward_kernel<T, false>, grid, kThreads, SharedMemory<false>::kBytes, params,
                      stream);
}

}  // namespace flash_msa::cuda::sm90
