// Hopper (wgmma) sparse main-attention backward of MSA (SPEC section 4), the same algorithm,
// work items and outputs as the portable kernel (backward/portable/sparse_kernel.cuh: dQ per edge,
// dK and dV per item, the teacher per edge), so the reductions that follow are shared.
//
// One CTA takes a work item and keeps K_n, V_n of its block in shared memory, and the item's
// entries decoded (token, document start, edge; schedule::ItemRows), so that no global load
// stands between a tile and its gather; its two warpgroups share each 64-row query tile
// (floor(64 / G) tokens x G heads; Q, dO and the rows' lse, Delta double-buffered, the next
// tile's gather in flight) and split the block's keys: warpgroup w owns keys 64 w .. 64 w + 63
// and their dK, dV in registers (2 x 64 fp32 per thread). Per tile:
//   S = Q K_w^T, dP = dO V_w^T              (m64n64k16 from shared memory)
//   P = exp2(S scale log2e - lse log2e), dS = P (dP - Delta), both to shared memory in the dtype
//   dV_w += P_w^T dO, dK_w += dS_w^T Q      (m64n128k16; P^T, dS^T read MN-major: no
//                                            transposing copies)
//   dQ[:, 64 w ..] = dS K[:, 64 w ..]       (the whole dS, so each warpgroup owns 64 columns;
//                                            stored per edge in the dtype)
// with one CTA barrier between the two phases (dQ needs both halves of dS) and one per tile.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/backward/sm90/sparse_sm90.h"
#include "cuda/common/backward_tile_sm90.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::sm90::sparse_backward {

using namespace backward_tile;
inline constexpr int kThreads = 256;  // two warpgroups
inline constexpr float kLog2e = 1.4426950408889634f;

// Byte offsets of the SW128-panel tiles (wgmma_sm90.cuh): K, V, Q[2], dO[2], P, dS; plus slack
// to align the start to 1024 bytes.
struct SharedMemory {
  static constexpr int kKv = kKeys * kD * 2;
  static constexpr int kTile = kRows * kD * 2;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKv;
  static constexpr int kQ = kV + kKv;
  static constexpr int kDout = kQ + 2 * kTile;
  static constexpr int kP = kDout + 2 * kTile;
  static constexpr int kDs = kP + kRows * kKeys * 2;
  static constexpr int kBytes = kDs + kRows * kKeys * 2 + 1024;
};

template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    backward_kernel(const portable::SparseBackwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = SharedMemory;
  extern __shared__ unsigned char smem_raw[];
  __shared__ schedule::ItemRows rows;
  __shared__ schedule::TileRows<kRows> tile_rows;
  __shared__ float row_stats[2][2][kRows];  // [tile buffer][lse, Delta][tile row]
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* s_p = smem + Smem::kP;
  unsigned char* s_ds = smem + Smem::kDs;

  schedule::Item item;
  if (!schedule::find_item(p.items, p.shape, blockIdx.x, item)) return;
  const int wg = warpgroup_index(), warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int b = item.b, head0 = item.head0, key0 = item.key0;
  const int kv = head0 / p.shape.kv_group;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.stride_b + kv * p.k.stride_h;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.stride_b + kv * p.v.stride_h;
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.stride_b + head0 * p.q.stride_h;
  const T* dout =
      static_cast<const T*>(p.dout.data) + b * p.dout.stride_b + head0 * p.dout.stride_h;
  // lse / delta of head0 at position 0 (query_row of head0 + g at position t: + g Sq + t).
  const int64_t stats = p.shape.query_row(int64_t(b) * p.shape.heads + head0, 0);

  // Keys past the sequence: zeros (their address clamped to the last key).
  auto key_row = [&](int r, bool& valid) {
    valid = key0 + r < p.shape.seqlen;
    return min(key0 + r, p.shape.seqlen - 1);
  };
  copy_rows_sw128<kKeys, kD, kThreads>(
      smem + Smem::kK, [&](int r, bool& valid) { return k + key_row(r, valid) * p.k.stride_s; },
      threadIdx.x);
  copy_rows_sw128<kKeys, kD, kThreads>(
      smem + Smem::kV, [&](int r, bool& valid) { return v + key_row(r, valid) * p.v.stride_s; },
      threadIdx.x);
  cp_async_commit();
  schedule::load_item_rows<kThreads>(rows, item, p, threadIdx.x);
  schedule::fill_tile_rows<kRows, kThreads>(tile_rows, p.shape.group, threadIdx.x);
  __syncthreads();  // the item's and the tile's rows are in place

  const int item_rows = item.end - item.begin;
  const int tile_tokens = kRows / p.shape.group;
  // Tile row r of the tile at item row t0: head head0 + tile_rows.row[r].head, token
  // row_token(t0, r, valid).
  auto row_token = [&](int t0, int r, bool& valid) {
    return tile_rows.token_of(rows, t0, r, item_rows, valid);
  };
  // Q, dO, lse and Delta of the tile at item row t0, into buffer buf.
  auto load_tile = [&](int t0, int buf) {
    copy_rows_sw128<kRows, kD, kThreads>(
        smem + Smem::kQ + buf * Smem::kTile,
        [&](int r, bool& valid) {
          return q + tile_rows.row[r].head * p.q.stride_h +
                 p.shape.query_at(row_token(t0, r, valid)) * p.q.stride_s;
        },
        threadIdx.x);
    copy_rows_sw128<kRows, kD, kThreads>(
        smem + Smem::kDout + buf * Smem::kTile,
        [&](int r, bool& valid) {
          return dout + tile_rows.row[r].head * p.dout.stride_h +
                 p.shape.query_at(row_token(t0, r, valid)) * p.dout.stride_s;
        },
        threadIdx.x);
    if (threadIdx.x < 2 * kRows) {
      const int r = threadIdx.x % kRows, which = threadIdx.x / kRows;
      bool valid;
      const uint32_t token = row_token(t0, r, valid);
      const int64_t at = stats + int64_t(tile_rows.row[r].head) * p.shape.queries + token;
      cp_async_4(&row_stats[buf][which][r], (which == 0 ? p.lse : p.delta) + at, valid);
    }
    cp_async_commit();
  };
  load_tile(0, 0);

  // dK, dV of key 64 wg + 16 warp + lane / 4 + 8 (e / 2), column 8 t + 2 (lane % 4) + e % 2 in
  // [4 t + e] (the m64n128 accumulator).
  float dk[64], dv[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) dk[j] = dv[j] = 0.f;
  // Descriptors: K-major operands (Q, dO, K, V in S and dP; dS in dQ) and K read MN-major in
  // dQ (one 64-column panel) step through 16-byte chunks; P, dS read MN-major step through rows;
  // Q, dO read MN-major in dV, dK span both 64-column panels, kRows rows apart.
  const uint64_t q_desc = sw128_desc(smem_addr(smem + Smem::kQ), 16, 1024);
  const uint64_t do_desc = sw128_desc(smem_addr(smem + Smem::kDout), 16, 1024);
  const uint64_t q_mn_desc = sw128_desc(smem_addr(smem + Smem::kQ), kRows * 128, 1024);
  const uint64_t do_mn_desc = sw128_desc(smem_addr(smem + Smem::kDout), kRows * 128, 1024);
  const uint64_t k_desc = sw128_desc(smem_addr(smem + Smem::kK), 16, 1024);
  const uint64_t v_desc = sw128_desc(smem_addr(smem + Smem::kV), 16, 1024);
  const uint64_t p_desc = sw128_desc(smem_addr(s_p), 16, 1024);
  const uint64_t ds_desc = sw128_desc(smem_addr(s_ds), 16, 1024);

  int buf = 0;
  for (int t0 = 0; t0 < item_rows; t0 += tile_tokens, buf ^= 1) {
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // this tile landed; the last tile's products are done with every buffer
    if (t0 + tile_tokens < item_rows) load_tile(t0 + tile_tokens, buf ^ 1);
    const uint32_t tile_offset = buf * Smem::kTile;
    const int live_tokens = min(tile_tokens, item_rows - t0);

    // S = Q K_w^T and dP = dO V_w^T.
    float s[32], dp[32];
    wgmma_fence();
    issue_scores<T>(s, dp, q_desc, do_desc, k_desc, v_desc, tile_offset, wg);
    wgmma_commit();

    // Rows 16 warp + 8 h + lane / 4, while the products run: their columns 64 wg + 8 c +
    // 2 (lane % 4) + e are visible from 8 c + e = lo[h] to hi[h] (none past the item; lse and
    // Delta are zero-filled there).
    int lo[2], hi[2];
    float lse2[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * warp + 8 * h + lane / 4, t = t0 + tile_rows.row[r].token;
      const int col0 = key0 + 64 * wg + 2 * (lane % 4);
      lo[h] = INT_MAX;
      hi[h] = INT_MIN;
      if (t < item_rows) {
        lo[h] = rows.first[t] - col0;
        hi[h] = rows.token[t] - col0;
      }
      lse2[h] = row_stats[buf][0][r] * kLog2e;
      delta[h] = row_stats[buf][1][r];
    }
    wgmma_wait<0>();
    fence_operands(s);
    fence_operands(dp);

    // P = exp2(S scale log2e - lse log2e), masked to 0 where not visible (most tiles see all
    // 64 keys: no masking then).
    mask_columns(s, lo, hi);
    const float base[2] = {-lse2[0], -lse2[1]};
    store_p_ds<T>(s_p, s_ds, s, dp, p.shape.scale_log2, base, delta, wg, warp, lane,
                  [](int, float) {});
    fence_async_shared();
    __syncthreads();  // both halves of P and dS are in place

    // dV_w += P_w^T dO, dK_w += dS_w^T Q; dQ = dS K[:, 64 wg ..].
    float dq[32];
    wgmma_fence();
    issue_gradients<T>(dv, dk, dq, p_desc, ds_desc, do_mn_desc, q_mn_desc, k_desc, tile_offset, wg);
    wgmma_commit();

    // The teacher: the mean over the G heads of P, per token and key, from shared memory; a
    // thread sums keys col, col + 1 of a token.
    if (p.teacher) {
      const float inv_group = 1.f / p.shape.group;
      for (int x = threadIdx.x; x < live_tokens * kKeys / 2; x += kThreads) {
        const int t = x / (kKeys / 2), col = 2 * (x % (kKeys / 2));
        float2 sum = {0.f, 0.f};
        for (int g = 0; g < p.shape.group; ++g) {
          const float2 pair = Elem<T>::unpack(*reinterpret_cast<const uint32_t*>(
              s_p + sw128_offset<kRows>(t * p.shape.group + g, col / 8) + (col % 8) * 2));
          sum.x += pair.x;
          sum.y += pair.y;
        }
        *reinterpret_cast<float2*>(p.teacher + rows.edge[t0 + t] * kKeys + col) =
            make_float2(sum.x * inv_group, sum.y * inv_group);
      }
    }

    wgmma_wait<0>();
    fence_operands(dq);
    // dQ partial rows in the dtype, fragment order (mma_sm80.cuh): this warpgroup's column
    // tiles are 8 wg ...
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const auto [token, head] = tile_rows.row[16 * warp + 8 * h + lane / 4];
      if (t0 + token >= item_rows) continue;
      uint32_t words[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        words[j] = Elem<T>::pack(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
      store_fragment_row<8, 1>(
          static_cast<T*>(p.dq_part) + (rows.edge[t0 + token] * p.shape.group + head) * kD,
          lane % 4, 8 * wg, words);
    }
  }

  fence_operands(dk);
  fence_operands(dv);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = 64 * wg + 16 * warp + 8 * h + lane / 4;
    const int64_t at = (int64_t(blockIdx.x) * kKeys + key) * kD + 2 * (lane % 4);
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      *reinterpret_cast<float2*>(p.dk_part + at + 8 * t) =
          make_float2(dk[4 * t + 2 * h], dk[4 * t + 2 * h + 1]);
      *reinterpret_cast<float2*>(p.dv_part + at + 8 * t) =
          make_float2(dv[4 * t + 2 * h], dv[4 * t + 2 * h + 1]);
    }
  }
#else
  __trap();  // built without sm_90a code: sparse_kernels() never picks it then
#endif
}

}  // namespace flash_msa::cuda::sm90::sparse_backward

namespace flash_msa::cuda::sm90 {

template <class T>
void launch_sparse_backward(const portable::SparseBackwardParams& params, cudaStream_t stream) {
  launch_large_smem(sparse_backward::backward_kernel<T>,
                    static_cast<unsigned>(params.items.max_items), sparse_backward::kThreads,
                    sparse_backward::SharedMemory::kBytes, params, stream);
}

}  // namespace flash_msa::cuda::sm90
