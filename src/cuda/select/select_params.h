// Contract of the proxy select that the portable kernel (portable/) and the Hopper kernel (sm90/)
// share: their parameters, the tile constants and the shared-memory plan of the portable kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common/shape.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::portable {

struct SelectKernelParams {
  ConstView qp;               // [B, Hp, S, Dp] strided, 16-byte aligned rows
  ConstView kp;               // [B, Hpk, S, Dp] strided, 16-byte aligned rows
  int32_t* indices;           // [B, Hp, S, K] contiguous
  const int32_t* cu_seqlens;  // [num_docs + 1] offsets over B*S tokens; null: one doc per row
  KernelShape shape;          // top_k <= kMaxTopK; num_blocks query tiles per (b, p)
  // The FP8 select of the Hopper kernel only (select/sm90): qp and kp are the E4M3 copies and
  // these the keys' scales, [B, Hpk, NB * 128] contiguous (1 past S); null otherwise.
  const float* key_scales = nullptr;
};

inline constexpr int kMaxTopK = 64;
inline constexpr int kBlockKeys = static_cast<int>(kBlockSize);
inline constexpr int kSelectBlockM = kBlockKeys;  // query rows per CTA: one block of queries
inline constexpr int kSelectThreads = 128;        // 4 warps x 32 query rows

// Dynamic shared memory of one CTA: two key tiles (cp.async double buffer), then a region that
// first holds the query tile and, once its fragments sit in registers, the per-row top-K lists
// (entries [K][128] of {score bits, block}, fill counts [128] int32).
struct SelectSmemPlan {
  int dp, top_k;
  __host__ __device__ constexpr size_t tile_bytes() const {
    return size_t(kSelectBlockM) * size_t(dp) * 2;
  }
  __host__ __device__ constexpr size_t key_tile_offset(int buf) const {
    return size_t(buf) * tile_bytes();
  }
  __host__ __device__ constexpr size_t region_offset() const { return 2 * tile_bytes(); }
  __host__ __device__ constexpr size_t entries_offset() const { return region_offset(); }
  __host__ __device__ constexpr size_t fill_offset() const {
    return entries_offset() + size_t(top_k) * kSelectBlockM * 2 * sizeof(int32_t);
  }
  __host__ __device__ constexpr size_t bytes() const {
    const size_t lists = fill_offset() + kSelectBlockM * sizeof(int32_t) - region_offset();
    return region_offset() + (lists > tile_bytes() ? lists : tile_bytes());
  }
};

}  // namespace flash_msa::cuda::portable
