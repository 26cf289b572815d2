// Kernel-private parameters and launchers of the portable sparse forward (key-block-outer, see
// sparse_kernel.cuh) and of its merge, explicitly instantiated per dtype (sparse_bf16.cu,
// sparse_fp16.cu) for D in {32, 64, 128}. One launch covers one token chunk.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm80 {

// Partial results of one edge (b, p, token, slot) of a chunk live at the chunk-local edge
// ce = ((b * Hp + p) * chunk_tokens + token - chunk_begin) * K + slot.
struct SparseForwardParams {
  ConstView q;  // [B, H, S, D] strided, 16-byte aligned rows (likewise k, v)
  ConstView k;  // [B, Hk, S, D]
  ConstView v;  // [B, Hk, S, D]
  schedule::Index index;
  schedule::Items items;
  void* o_part;     // [chunk edges, G, D] dtype, normalised per block, row in fragment order
  float* lse_part;  // [chunk edges, G] log2-domain log-sum-exp over the block's visible keys
  int chunk_begin, chunk_tokens;
  int seqlen, proxy_heads, group, kv_group, top_k, num_blocks, buckets;
  float scale_log2;  // scale * log2(e)
  // The proxy branch's per-edge lse, which the Hopper kernel computes along (Dp = 128) in place
  // of the proxy kernel's kLse pass when lse_p_part is set; the portable kernel leaves it.
  ConstView qp;            // [B, Hp, S, Dp] strided, 16-byte aligned rows
  ConstView kp;            // [B, Hpk, S, Dp]
  float* lse_p_part;       // [chunk edges] log2 domain, as ProxyParams::lse_p_part, or null
  int proxy_group;         // Hp / Hpk
  float proxy_scale_log2;  // proxy_scale * log2(e)
};

// Combines the partials of each token of a chunk (SPEC section 2): out, lse, and lse_proxy
// from the proxy branch's partials.
struct MergeParams {
  MutView out;               // [B, H, S, D] strided
  float* lse;                // [B, H, S] contiguous, natural log
  float* lse_proxy;          // [B, Hp, S] contiguous, natural log
  const void* o_part;        // as SparseForwardParams
  const float* lse_part;     // as SparseForwardParams
  const float* lse_p_part;   // [chunk edges] log2-domain, from the proxy kernel
  const float* kl_part;      // [chunk edges] KL terms of the block (launch_kl_rows only)
  float* kl_rows;            // [B, Hp, S] KL term of each query row (launch_kl_rows only)
  const int32_t* indices;    // [B, Hp, S, K] contiguous
  const int32_t* doc_start;  // [B * S]
  int chunk_begin, chunk_tokens, chunk_end;
  int batch, seqlen, heads, proxy_heads, group, top_k;
};

inline constexpr int kSparseMaxGroup = 64;  // G up to 64 (the backward's 64-row tiles)

template <class T, int kD>
void launch_sparse_forward(const SparseForwardParams& params, cudaStream_t stream);

template <class T, int kD>
void launch_merge(const MergeParams& params, cudaStream_t stream);

void launch_kl_rows(const MergeParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm80
