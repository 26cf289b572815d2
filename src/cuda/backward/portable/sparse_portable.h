// Kernel-private parameters and launchers of the portable sparse backward (key-block-outer, see
// sparse_kernel.cuh) and of its reductions (sparse_reduce.cu), explicitly instantiated per dtype
// (sparse_bf16.cu, sparse_fp16.cu) for D in {32, 64, 128}. One launch covers one token chunk;
// edges and items are numbered as in the forward (forward/sm80/sparse_sm80.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm80 {

struct SparseBackwardParams {
  ConstView q;     // [B, H, S, D] strided, 16-byte aligned rows (likewise k, v, dout)
  ConstView k;     // [B, Hk, S, D]
  ConstView v;     // [B, Hk, S, D]; unused in teacher mode
  ConstView dout;  // [B, H, S, D]; unused in teacher mode
  schedule::Index index;
  schedule::Items items;
  const float* lse;    // [B, H, S] natural log, from the forward
  const float* delta;  // [B, H, S] <out, dout>; unused in teacher mode
  void* dq_part;       // [chunk edges, G, D] dtype, dS K of the block (unscaled), rows in
                       // fragment order (mma_sm80.cuh); unused in teacher mode
  float* teacher;      // [chunk edges, 128] mean over the group's heads of P; null: not needed
  float* dk_part;      // [items, 128, D] dS^T Q of the item (unscaled); unused in teacher mode
  float* dv_part;      // [items, 128, D] P^T dO of the item; unused in teacher mode
  int chunk_begin, chunk_tokens;
  int seqlen, heads, proxy_heads, group, kv_group, top_k, num_blocks, buckets;
  float scale_log2;  // scale * log2(e)
};

// kTeacherOnly: only P and the teacher rows (the KL value of the forward needs them).
template <class T, int kD, bool kTeacherOnly>
void launch_sparse_backward(const SparseBackwardParams& params, cudaStream_t stream);

// ---- reductions (sparse_reduce.cu) ----

// delta[b, h, i] = <out[b, h, i], dout[b, h, i]> in fp32.
struct DeltaParams {
  ConstView out;   // [B, H, S, D] strided
  ConstView dout;  // [B, H, S, D] strided
  float* delta;    // [B, H, S]
  int batch, heads, seqlen, head_dim;
};

// Per-edge partial rows of a chunk summed over each token's valid slots (slot order), scaled and
// stored: dst[b, p * rows + g, i] = scale * sum_slots part[ce, g]. part null: zeros.
struct RowsReduceParams {
  const void* part;          // [chunk edges, rows, width] of Part (launch_rows_reduce), rows in
                             // fragment order (mma_sm80.cuh)
  MutView dst;               // [B, Hp * rows, S, width] strided
  const int32_t* indices;    // [B, Hp, S, K]
  const int32_t* doc_start;  // [B * S]
  float scale;
  int rows, width;  // rows per edge (G for dq, 1 for dqp), columns
  int chunk_begin, chunk_tokens, chunk_end;
  int batch, seqlen, proxy_heads, top_k;
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
  int batch, seqlen, proxy_heads, num_blocks;
};

// dst = scale * acc in the dtype; acc null: zeros.
struct KeysStoreParams {
  const float* acc;  // [B, heads, S, width]
  MutView dst;       // [B, heads, S, width] strided
  float scale;
  int batch, heads, seqlen, width;
};

template <class T>
void launch_delta(const DeltaParams& params, cudaStream_t stream);
// Part: the partials' element type, the dtype T (dQ) or float (dQp).
template <class T, class Part>
void launch_rows_reduce(const RowsReduceParams& params, cudaStream_t stream);
void launch_keys_reduce(const KeysReduceParams& params, cudaStream_t stream);
template <class T>
void launch_keys_store(const KeysStoreParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm80
