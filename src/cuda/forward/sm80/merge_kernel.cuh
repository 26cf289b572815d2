// Second pass of the sparse forward: each (token, head) combines its per-block partials,
//   lse = log sum_n exp(lse_n),  out = sum_n exp(lse_n - lse) o_n,
// over the valid slots of its index row in slot order (so the result does not depend on how
// the schedule ordered the work), and the proxy head's lse_proxy likewise from the proxy
// branch's per-block partials. One thread per 8 output columns; memory-bound.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/forward/sm80/sparse_sm80.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::sm80::merge {

inline constexpr int kThreads = 256;
inline constexpr float kLn2 = 0.6931471805599453f;

// log2 of sum over the set bits k of `slots` of exp2(part[k * stride]); -inf for no slots.
__device__ __forceinline__ float merge_lse2(const float* part, int64_t stride, uint64_t slots) {
  float mx = -INFINITY;
  for (uint64_t s = slots; s; s &= s - 1) mx = fmaxf(mx, part[(__ffsll(s) - 1) * stride]);
  if (mx == -INFINITY) return -INFINITY;
  float sum = 0.f;
  for (uint64_t s = slots; s; s &= s - 1) sum += exp2f(part[(__ffsll(s) - 1) * stride] - mx);
  return mx + __log2f(sum);
}

template <class T, int kD>
__global__ void __launch_bounds__(kThreads) merge_kernel(const MergeParams p) {
  constexpr int kChunks = kD / 8;  // 8 columns (16 bytes of a partial row) per thread
  const int tokens = p.chunk_end - p.chunk_begin;
  int64_t x = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (x >= int64_t(p.batch) * p.proxy_heads * tokens * p.group * kChunks) return;
  const int chunk = static_cast<int>(x % kChunks);
  x /= kChunks;
  const int g = static_cast<int>(x % p.group);
  x /= p.group;
  const int t = static_cast<int>(x % tokens);
  const int64_t bp = x / tokens;
  const int b = static_cast<int>(bp / p.proxy_heads),
            head = static_cast<int>(bp % p.proxy_heads) * p.group + g;
  const int i = p.chunk_begin + t;

  const uint64_t slots =
      schedule::valid_slots(p.indices + (bp * p.seqlen + i) * p.top_k, p.top_k, i / 128,
                            __ldg(p.doc_start + int64_t(b) * p.seqlen + i) / 128);
  const int64_t ce0 = (bp * p.chunk_tokens + t) * p.top_k;  // chunk-local edge of slot 0
  const float lse2 = merge_lse2(p.lse_part + ce0 * p.group + g, p.group, slots);

  float acc[8] = {};
  // Independent iterations, unrolled so that several 16-byte loads are in flight.
#pragma unroll 4
  for (int k = 0; k < p.top_k; ++k) {
    if (!((slots >> k) & 1)) continue;
    const int64_t row = (ce0 + k) * p.group + g;
    const float w = exp2f(p.lse_part[row] - lse2);
    const uint4 v =
        reinterpret_cast<const uint4*>(static_cast<const T*>(p.o_part) + row * kD)[chunk];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = Elem<T>::unpack(words[e]);
      acc[2 * e] += w * f.x;
      acc[2 * e + 1] += w * f.y;
    }
  }
  // Fragment order: lane quad c holds columns 8 t + 2 c (+1) for t = 0 .. D/8 - 1, contiguously.
  const int c = chunk * 8 / (kD / 4), t0 = (chunk * 8 % (kD / 4)) / 2;
  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + head * p.out_stride_h + i * p.out_stride_s;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    *reinterpret_cast<uint32_t*>(out + (t0 + e) * 8 + 2 * c) =
        Elem<T>::pack(acc[2 * e], acc[2 * e + 1]);
  if (chunk == 0) p.lse[(int64_t(b) * p.heads + head) * p.seqlen + i] = lse2 * kLn2;
  if (chunk == 0 && g == 0)
    p.lse_proxy[bp * p.seqlen + i] = merge_lse2(p.lse_p_part + ce0, 1, slots) * kLn2;
}

}  // namespace flash_msa::cuda::sm80::merge

namespace flash_msa::cuda::sm80 {

template <class T, int kD>
void launch_merge(const MergeParams& params, cudaStream_t stream) {
  const int64_t threads = int64_t(params.batch) * params.proxy_heads *
                          (params.chunk_end - params.chunk_begin) * params.group * (kD / 8);
  merge::merge_kernel<T, kD>
      <<<static_cast<unsigned>((threads + merge::kThreads - 1) / merge::kThreads), merge::kThreads,
         0, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::sm80
