// The shape numbers every kernel reads, filled once per call from the Problem (host/plan.h:
// kernel_shape) and embedded in each kernel's parameters, so that no kernel's parameter struct
// repeats them. int32: the CUDA backend's limits (host/limits.h) keep every one in range.
#pragma once

namespace flash_msa::cuda {

struct KernelShape {
  int batch;               // B
  int seqlen;              // S, tokens per batch row
  int heads;               // H main query heads
  int proxy_heads;         // Hp proxy query heads
  int group;               // G = H / Hp main heads per proxy head
  int kv_group;            // H / Hk main heads per key/value head
  int proxy_group;         // Hp / Hpk proxy heads per proxy key head
  int head_dim;            // D
  int proxy_head_dim;      // Dp
  int top_k;               // K selected blocks per (token, proxy head); 0 in warmup
  int num_blocks;          // NB = ceil(S / 128) key blocks per batch row
  int buckets;             // B * Hp * NB schedule buckets (b, p, key block)
  int num_docs;            // documents in cu_seqlens; 0 without
  float scale;             // main softmax scale
  float proxy_scale;       // proxy score scale
  float scale_log2;        // scale * log2(e)
  float proxy_scale_log2;  // proxy_scale * log2(e)
  float inv_rows;          // 1 / (B * Hp * S), the KL mean (over every row, also for a shard)
  // The queries (Problem::query_offset, queries()): query-side tensors hold `queries` tokens
  // per batch row, at positions query_offset .. query_offset + queries - 1. Kernels count
  // tokens by position; query_row() and query_at() turn one into a query-side index.
  int query_offset;        // Q0
  int queries;             // Sq

  // Row of a contiguous [.., Sq] query-side array ([B, H, Sq] statistics, [B, Hp, Sq, K]
  // indices) for row bh of its leading dimensions and the query at position `token`.
  __host__ __device__ int64_t query_row(int64_t bh, int token) const {
    return bh * queries + (token - query_offset);
  }
  // Token index of the query at position `token` in a query-side view.
  __host__ __device__ int query_at(int token) const { return token - query_offset; }
};

// The token chunk one launch of a sparse pass covers: tokens [begin, end) of every batch row;
// the chunk's partial buffers are laid out for `tokens` tokens per row (end - begin <= tokens).
struct Chunk {
  int begin, tokens, end;
};

}  // namespace flash_msa::cuda
