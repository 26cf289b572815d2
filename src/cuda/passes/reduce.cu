// Memory-bound passes of the sparse backward around the key-block-outer kernels: Delta, the
// per-token sums of dQ / dQp partials over the token's slots, the per-key sums of dK / dV / dKp
// partials over a block's items, and the final scaled stores. Every sum runs in a fixed order,
// so the gradients are bitwise reproducible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mma_sm80.cuh"
#include "cuda/host/check.h"
#include "cuda/passes/passes.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::passes {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

// D / 8 lanes per (b, h, i) row (an aligned segment of the warp), 16 bytes of out and dout each.
template <class T>
__global__ void __launch_bounds__(kThreads) delta_kernel(const DeltaParams p) {
  const int lanes = p.shape.head_dim / 8;
  const int64_t rows = int64_t(p.shape.batch) * p.shape.heads * p.shape.queries;
  const int64_t x = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  // Lanes past the end stay (on the last row) for the segment's shuffles but store nothing.
  const int64_t row = min(x / lanes, rows - 1);
  const int c = static_cast<int>(x % lanes) * 8;
  const int i = static_cast<int>(row % p.shape.queries);  // the query's index in the views
  const int64_t bh = row / p.shape.queries;
  const int b = static_cast<int>(bh / p.shape.heads), h = static_cast<int>(bh % p.shape.heads);
  const uint4 o =
      *reinterpret_cast<const uint4*>(static_cast<const T*>(p.out.data) + b * p.out.stride_b +
                                      h * p.out.stride_h + i * p.out.stride_s + c);
  const uint4 d =
      *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout.data) + b * p.dout.stride_b +
                                      h * p.dout.stride_h + i * p.dout.stride_s + c);
  const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 a = Elem<T>::unpack(ow[e]), g = Elem<T>::unpack(dw[e]);
    sum += a.x * g.x + a.y * g.y;
  }
  for (int off = lanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (c == 0 && x / lanes < rows) p.delta[row] = sum;
}

// The 8 values at positions 8 j .. of a partial row (one or two 16-byte loads).
__device__ __forceinline__ void load_octet(const float* src, float (&v)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(src)[0];
  const float4 hi = reinterpret_cast<const float4*>(src)[1];
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z,
  v[7] = hi.w;
}
template <class T>
__device__ __forceinline__ void load_octet(const T* src, float (&v)[8]) {
  const uint4 bits = *reinterpret_cast<const uint4*>(src);
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = Elem<T>::unpack(words[e]);
    v[2 * e] = f.x;
    v[2 * e + 1] = f.y;
  }
}

// One thread per 8 positions (four column pairs, fragment order) of one (b, p, token, g) row.
template <class T, class Part>
__global__ void __launch_bounds__(kThreads) rows_reduce_kernel(const RowsReduceParams p) {
  const int octets = p.width / 8, tokens = p.chunk.end - p.chunk.begin;
  int64_t x = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (x >= int64_t(p.shape.batch) * p.shape.proxy_heads * tokens * p.rows * octets) return;
  const int j = static_cast<int>(x % octets);
  x /= octets;
  const int g = static_cast<int>(x % p.rows);
  x /= p.rows;
  const int t = static_cast<int>(x % tokens);
  const int64_t bp = x / tokens;
  const int b = static_cast<int>(bp / p.shape.proxy_heads),
            ph = static_cast<int>(bp % p.shape.proxy_heads);
  const int i = p.chunk.begin + t;
  float acc[8] = {};
  if (p.part) {
    const uint64_t slots =
        schedule::valid_slots(p.indices + p.shape.query_row(bp, i) * p.shape.top_k,
                              p.shape.top_k, i / 128,
                              __ldg(p.doc_start + int64_t(b) * p.shape.seqlen + i) / 128);
    const int64_t ce0 = (bp * p.chunk.tokens + t) * p.shape.top_k;
    const Part* part = static_cast<const Part*>(p.part) + g * p.width + 8 * j;
    // Independent iterations, unrolled so that several loads are in flight.
#pragma unroll 4
    for (int k = 0; k < p.shape.top_k; ++k) {
      if (!((slots >> k) & 1)) continue;
      float v[8];
      load_octet(part + (ce0 + k) * p.rows * p.width, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += v[e];
    }
  }
  T* dst = static_cast<T*>(p.dst.data) + b * p.dst.stride_b +
           (int64_t(ph) * p.rows + g) * p.dst.stride_h + p.shape.query_at(i) * p.dst.stride_s +
           fragment_column(j);
#pragma unroll
  for (int e = 0; e < 4; ++e)
    *reinterpret_cast<uint32_t*>(dst + 8 * e) =
        Elem<T>::pack(p.scale * acc[2 * e], p.scale * acc[2 * e + 1]);
}

// One thread per 4 columns of one (b, c, key) row of the accumulator.
__global__ void __launch_bounds__(kThreads) keys_reduce_kernel(const KeysReduceParams p) {
  const int quads = p.width / 4;
  int64_t x = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (x >= int64_t(p.shape.batch) * p.out_heads * p.keys * quads) return;
  const int col = static_cast<int>(x % quads) * 4;
  x /= quads;
  const int j = static_cast<int>(x % p.keys);
  const int64_t bc = x / p.keys;
  const int b = static_cast<int>(bc / p.out_heads), c = static_cast<int>(bc % p.out_heads);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  bool any = false;
  for (int ph = c * p.heads_per_out; ph < (c + 1) * p.heads_per_out; ++ph) {
    const int64_t bucket = (int64_t(b) * p.shape.proxy_heads + ph) * p.shape.num_blocks + j / 128;
    const int end = __ldg(p.items.item_begin + bucket + 1);
    for (int item = __ldg(p.items.item_begin + bucket); item < end; ++item) {
      const float4 v = *reinterpret_cast<const float4*>(
          p.part + (int64_t(item) * 128 + j % 128) * p.width + col);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
      any = true;
    }
  }
  if (!any) return;
  float4* dst = reinterpret_cast<float4*>(p.acc + (bc * p.shape.seqlen + j) * p.width + col);
  float4 d = *dst;
  d.x += acc.x;
  d.y += acc.y;
  d.z += acc.z;
  d.w += acc.w;
  *dst = d;
}

template <class T>
__global__ void __launch_bounds__(kThreads) keys_store_kernel(const KeysStoreParams p) {
  const int quads = p.width / 4;
  int64_t x = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (x >= int64_t(p.shape.batch) * p.out_heads * p.tokens * quads) return;
  const int col = static_cast<int>(x % quads) * 4;
  const int64_t row = x / quads;
  const int j = static_cast<int>(row % p.tokens);
  const int64_t bh = row / p.tokens;
  const int b = static_cast<int>(bh / p.out_heads), h = static_cast<int>(bh % p.out_heads);
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.acc)
    v = *reinterpret_cast<const float4*>(p.acc + row * p.width +
                                         (p.permuted ? col ^ 8 * (j % 8) : col));
  T* dst = static_cast<T*>(p.dst.data) + b * p.dst.stride_b + h * p.dst.stride_h +
           j * p.dst.stride_s + col;
  *reinterpret_cast<uint32_t*>(dst) = Elem<T>::pack(p.scale * v.x, p.scale * v.y);
  *reinterpret_cast<uint32_t*>(dst + 2) = Elem<T>::pack(p.scale * v.z, p.scale * v.w);
}

}  // namespace

template <class T>
void launch_delta(const DeltaParams& params, cudaStream_t stream) {
  delta_kernel<T><<<blocks_for(int64_t(params.shape.batch) * params.shape.heads *
                               params.shape.queries * (params.shape.head_dim / 8)),
                    kThreads, 0, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

template <class T, class Part>
void launch_rows_reduce(const RowsReduceParams& params, cudaStream_t stream) {
  const int64_t threads = int64_t(params.shape.batch) * params.shape.proxy_heads *
                          (params.chunk.end - params.chunk.begin) * params.rows *
                          (params.width / 8);
  rows_reduce_kernel<T, Part><<<blocks_for(threads), kThreads, 0, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

void launch_keys_reduce(const KeysReduceParams& params, cudaStream_t stream) {
  const int64_t threads =
      int64_t(params.shape.batch) * params.out_heads * params.keys * (params.width / 4);
  keys_reduce_kernel<<<blocks_for(threads), kThreads, 0, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

template <class T>
void launch_keys_store(const KeysStoreParams& params, cudaStream_t stream) {
  const int64_t threads =
      int64_t(params.shape.batch) * params.out_heads * params.tokens * (params.width / 4);
  keys_store_kernel<T><<<blocks_for(threads), kThreads, 0, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

#define FLASH_MSA_REDUCE_TYPES(T)                                                    \
  template void launch_delta<T>(const DeltaParams&, cudaStream_t);                   \
  template void launch_rows_reduce<T, T>(const RowsReduceParams&, cudaStream_t);     \
  template void launch_rows_reduce<T, float>(const RowsReduceParams&, cudaStream_t); \
  template void launch_keys_store<T>(const KeysStoreParams&, cudaStream_t);
FLASH_MSA_REDUCE_TYPES(__nv_bfloat16)
FLASH_MSA_REDUCE_TYPES(__half)
#undef FLASH_MSA_REDUCE_TYPES

}  // namespace flash_msa::cuda::passes
