// Chip-neutral passes of the sparse forward and backward, around their main kernels: the merge
// of the forward's per-block partials, the KL value (teacher rows, per-row terms, the scalar),
// Delta, and the fixed-order reductions and stores of the backward's partials. Plain CUDA-core
// kernels (the teacher reuses the portable sparse backward kernel in teacher mode), the same on
// every chip. Every sum runs in a fixed order, so results are bitwise reproducible.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/backward/sparse_params.h"
#include "cuda/common/shape.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::passes {

// ---- forward: merge (merge.cu) and KL value (kl.cu, teacher.cu) ----

// Combines the partials of each token of a chunk (SPEC section 2): out, lse, and lse_proxy
// from the proxy branch's partials; launch_kl_rows sums a row's KL terms.
struct MergeParams {
  MutView out;                // [B, H, Sq, D] strided
  float* lse;                 // [B, H, Sq] contiguous, natural log
  float* lse_proxy;           // [B, Hp, Sq] contiguous, natural log
  const void* o_part;         // [chunk edges, G, D] dtype (portable::SparseForwardParams)
  const float* lse_part;      // [chunk edges, G] log2 domain
  const float* lse_p_part;    // [chunk edges] log2 domain, the proxy branch's
  const float* kl_part;       // [chunk edges] KL terms of the block (launch_kl_rows only)
  float* kl_rows;             // [B, Hp, Sq] KL term of each query row (launch_kl_rows only)
  const int32_t* indices;     // [B, Hp, Sq, K] contiguous
  const int32_t* doc_start;   // [B * S]
  const int32_t* tile_count;  // [B * Hp * NB] schedule::Tiles::count: rows of listed tiles are
                              // skipped; null without the tile path
  KernelShape shape;
  Chunk chunk;
};

template <class T, int kD>
void launch_merge(const MergeParams& params, cudaStream_t stream);

void launch_kl_rows(const MergeParams& params, cudaStream_t stream);

// kl = sum of the B * Hp * Sq row terms `partial` / (B * Hp * S), in a fixed order; one CTA.
void launch_kl_reduce(const float* partial, const KernelShape& shape, float* kl,
                      cudaStream_t stream);
// The same over `count` terms of any grouping.
void launch_kl_sum(const float* partial, int64_t count, const KernelShape& shape, float* kl,
                   cudaStream_t stream);

// The teacher rows of a chunk (mean over the group's heads of P per edge) for the KL value:
// the portable sparse backward kernel in teacher mode (reads q, k, index, items, lse).
template <class T, int kD>
void launch_teacher(const portable::SparseBackwardParams& params, cudaStream_t stream);

// ---- backward: Delta and the reductions (reduce.cu) ----

// delta[b, h, i] = <out[b, h, i], dout[b, h, i]> in fp32.
struct DeltaParams {
  ConstView out;   // [B, H, Sq, D] strided
  ConstView dout;  // [B, H, Sq, D] strided
  float* delta;    // [B, H, Sq]
  KernelShape shape;
};

// Per-edge partial rows of a chunk summed over each token's valid slots (slot order), scaled and
// stored: dst[b, p * rows + g, i] = scale * sum_slots part[ce, g]. part null: zeros.
struct RowsReduceParams {
  const void* part;          // [chunk edges, rows, width] of Part (launch_rows_reduce), rows in
                             // fragment order (mma_sm80.cuh)
  MutView dst;               // [B, Hp * rows, Sq, width] strided
  const int32_t* indices;    // [B, Hp, Sq, K]
  const int32_t* doc_start;  // [B * S]
  float scale;
  int rows, width;  // rows per edge (G for dq, 1 for dqp), columns
  KernelShape shape;
  Chunk chunk;
};

// Per-item partial key rows of a chunk added into fp32 accumulators, for every key head c:
// acc[b, c, j] += sum over the proxy heads p of c and the items of bucket (b, p, j / 128), in
// order, of part[item, j % 128].
struct KeysReduceParams {
  const float* part;  // [items, 128, width]
  float* acc;         // [B, out_heads, S, width]
  schedule::Items items;
  int width, out_heads, heads_per_out;  // proxy heads per key head
  int keys;  // rows [0, keys) of each head: the blocks the chunk's tokens can select
  KernelShape shape;
};

// dst = scale * acc in the dtype; acc null: zeros.
struct KeysStoreParams {
  const float* acc;  // [B, out_heads, tokens, width]
  MutView dst;       // [B, out_heads, tokens, width] strided
  float scale;
  int out_heads, width;
  int tokens;     // rows per head: S for key rows, Sq for query rows
  bool permuted;  // acc rows permuted as the dense Hopper backward's: column c of row j at
                  // c ^ 8 (j % 8)
  KernelShape shape;
};

template <class T>
void launch_delta(const DeltaParams& params, cudaStream_t stream);
// Part: the partials' element type, the dtype T (dQ) or float (dQp).
template <class T, class Part>
void launch_rows_reduce(const RowsReduceParams& params, cudaStream_t stream);
void launch_keys_reduce(const KeysReduceParams& params, cudaStream_t stream);
template <class T>
void launch_keys_store(const KeysStoreParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::passes
