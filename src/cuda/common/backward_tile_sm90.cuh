// The per-tile tensor-core work of the Hopper backward kernels, shared by the sparse
// (backward/sm90) and the dense warmup (warmup/sm90) kernels: a 64-row query tile against a
// 128-key block whose keys two warpgroups split (warpgroup wg owns keys 64 wg .. 64 wg + 63),
// every tile in SW128 panels (wgmma_sm90.cuh) in shared memory.
#pragma once

#include <cstdint>

#include "cuda/common/wgmma_sm90.cuh"

namespace flash_msa::cuda::sm90::backward_tile {

inline constexpr int kRows = 64;   // rows of a query tile
inline constexpr int kKeys = 128;  // keys of a block
inline constexpr int kD = 128;     // head dim (two 64-column panels)

// Stores the values of keys col, col + 1 (col even) of row r of a [kRows, 128] P or dS tile.
template <class T>
__device__ __forceinline__ void store_pair(unsigned char* tile, int r, int col, float lo,
                                           float hi) {
  *reinterpret_cast<uint32_t*>(tile + sw128_offset<kRows>(r, col / 8) + (col % 8) * 2) =
      Elem<T>::pack(lo, hi);
}

// P = exp2(S scale_log2 + base) (base: -lse log2e of the row) and dS = P (dP - Delta) of this
// thread's entries of an m64n64 tile (row 16 warp + 8 h + lane / 4, key 64 wg + 8 c + 2 (lane % 4)
// + e in [4 c + 2 h + e]; S at -inf where not visible) into the P and dS tiles in the dtype;
// on_p(j, P) sees each fp32 P, j its entry (the dense kernel's teacher sum).
template <class T, class OnP>
__device__ __forceinline__ void store_p_ds(unsigned char* s_p, unsigned char* s_ds,
                                           const float (&s)[32], const float (&dp)[32],
                                           float scale_log2, const float (&base)[2],
                                           const float (&delta)[2], int wg, int warp, int lane,
                                           OnP&& on_p) {
#pragma unroll
  for (int c = 0; c < 8; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float pr[2], ds[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 4 * c + 2 * h + e;
        pr[e] = fast_exp2(fmaf(s[j], scale_log2, base[h]));
        ds[e] = pr[e] * (dp[j] - delta[h]);
        on_p(j, pr[e]);
      }
      const int r = 16 * warp + 8 * h + lane / 4, col = 64 * wg + 8 * c + 2 * (lane % 4);
      store_pair<T>(s_p, r, col, pr[0], pr[1]);
      store_pair<T>(s_ds, r, col, ds[0], ds[1]);
    }
}

// Issues S = Q K_wg^T and dP = dO V_wg^T (m64n64k16 from shared memory; K-steps of 16 columns,
// 4 per 64-column panel; this warpgroup's keys are rows 64 wg .. of each K / V panel), the tile
// at tile_offset bytes from the Q and dO descriptors. The caller commits and waits.
template <class T>
__device__ __forceinline__ void issue_scores(float (&s)[32], float (&dp)[32], uint64_t q_desc,
                                             uint64_t do_desc, uint64_t k_desc, uint64_t v_desc,
                                             uint32_t tile_offset, int wg) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t panel = tile_offset + (kk / 4) * kRows * 128 + (kk % 4) * 32;
    const uint32_t kv_panel = (kk / 4) * kKeys * 128 + 64 * wg * 128 + (kk % 4) * 32;
    wgmma_m64n64k16_ss<T, 0, 0>(s, desc_add(q_desc, panel), desc_add(k_desc, kv_panel), kk > 0);
    wgmma_m64n64k16_ss<T, 0, 0>(dp, desc_add(do_desc, panel), desc_add(v_desc, kv_panel), kk > 0);
  }
}

// Issues dV_wg += P_wg^T dO and dK_wg += dS_wg^T Q over the tile's rows (16 per step; P, dS
// read MN-major from panel wg; dO, Q MN-major, both 64-column panels at once) and dQ = dS
// K[:, 64 wg ..] over the block's keys (dS K-major, K MN-major from panel wg). The caller
// commits and waits.
template <class T>
__device__ __forceinline__ void issue_gradients(float (&dv)[64], float (&dk)[64], float (&dq)[32],
                                                uint64_t p_desc, uint64_t ds_desc,
                                                uint64_t do_mn_desc, uint64_t q_mn_desc,
                                                uint64_t k_desc, uint32_t tile_offset, int wg) {
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    const uint32_t rows16 = kk * 16 * 128;
    wgmma_m64n128k16_ss<T, 1, 1>(dv, desc_add(p_desc, wg * kRows * 128 + rows16),
                                 desc_add(do_mn_desc, tile_offset + rows16), true);
    wgmma_m64n128k16_ss<T, 1, 1>(dk, desc_add(ds_desc, wg * kRows * 128 + rows16),
                                 desc_add(q_mn_desc, tile_offset + rows16), true);
  }
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk)
    wgmma_m64n64k16_ss<T, 0, 1>(dq, desc_add(ds_desc, (kk / 4) * kRows * 128 + (kk % 4) * 32),
                                desc_add(k_desc, wg * kKeys * 128 + kk * 16 * 128), kk > 0);
}

}  // namespace flash_msa::cuda::sm90::backward_tile
