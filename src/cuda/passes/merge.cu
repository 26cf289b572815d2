// Second pass of the sparse forward: each (token, head) combines its per-block partials,
//   lse = log sum_n exp(lse_n),  out = sum_n exp(lse_n - lse) o_n,
// over the valid slots of its index row in slot order (so the result does not depend on how
// the schedule ordered the work), and the proxy head's lse_proxy likewise from the proxy
// branch's per-block partials. One thread per 8 output columns; memory-bound. The rows of the
// tile path's tiles (schedule::Tiles) are left as the tile path wrote them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/instantiate.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/host/check.h"
#include "cuda/passes/passes.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::passes::merge {

inline constexpr int kThreads = 256;
inline constexpr float kLn2 = 0.6931471805599453f;

// The kLanes = D / 8 lanes of one (token, head) row (an aligned segment of the warp; lane `sub`
// of it) cooperate on the row's per-slot scalars, so that their loads go out together rather
// than one dependent load per slot: lane sub takes slots sub, sub + kLanes, ...

template <int kLanes>
__device__ __forceinline__ float segment_max(float x) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

template <int kLanes>
__device__ __forceinline__ float segment_sum(float x) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// schedule::valid_slots of an index row with the entries loaded across the segment. Slot k is
// valid when its block is visible and above every visible block of the slots before it (the
// largest of those is the last valid one): a prefix maximum over the segment per round of
// kLanes slots.
template <int kLanes>
__device__ __forceinline__ uint64_t valid_slots(const int32_t* row, int top_k, int own_block,
                                                int first_block, int sub) {
  const int segment = threadIdx.x % 32 - sub;  // the segment's first lane in the warp
  uint64_t mask = 0;
  int before = -1;  // largest visible block of the earlier rounds
  for (int k0 = 0; k0 < top_k; k0 += kLanes) {
    const int k = k0 + sub;
    const int n = k < top_k ? __ldg(row + k) : -1;
    const bool visible = k < top_k && n >= first_block && n <= own_block;
    int upto = visible ? n : -1;  // inclusive prefix maximum over the segment
#pragma unroll
    for (int o = 1; o < kLanes; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, upto, o, kLanes);
      if (sub >= o) upto = max(upto, y);
    }
    const int prior = __shfl_up_sync(0xffffffffu, upto, 1, kLanes);
    const bool valid = visible && n > max(before, sub > 0 ? prior : -1);
    const uint32_t bits = __ballot_sync(0xffffffffu, valid) >> segment;
    mask |= uint64_t(kLanes == 32 ? bits : bits & ((1u << kLanes) - 1)) << k0;
    before = max(before, __shfl_sync(0xffffffffu, upto, kLanes - 1, kLanes));
  }
  return mask;
}

// The merged lse (log2) of part[k * stride] over the set bits k of `slots`, -inf for none; lane
// sub's values of slots k = sub + kLanes j stay in v[j] (-inf where not valid).
template <int kLanes>
__device__ __forceinline__ float merge_lse2(const float* part, int64_t stride, uint64_t slots,
                                            int sub, float (&v)[64 / kLanes]) {
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < 64 / kLanes; ++j) {
    const int k = sub + kLanes * j;
    v[j] = (slots >> k) & 1 ? part[k * stride] : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
  mx = segment_max<kLanes>(mx);
  // No early return for a segment without valid slots: the shuffles span the whole warp.
  const float base = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 64 / kLanes; ++j) sum += fast_exp2(v[j] - base);
  sum = segment_sum<kLanes>(sum);
  return mx == -INFINITY ? -INFINITY : mx + fast_log2(sum);
}

template <class T, int kD>
__global__ void __launch_bounds__(kThreads) merge_kernel(const MergeParams p) {
  constexpr int kChunks = kD / 8;  // 8 columns (16 bytes of a partial row) per lane
  const int tokens = p.chunk.end - p.chunk.begin;
  int64_t x = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  // Lanes past the end stay (on the last row) for the segment's shuffles but store nothing.
  const int64_t total =
      int64_t(p.shape.batch) * p.shape.proxy_heads * tokens * p.shape.group * kChunks;
  const bool live = x < total;
  x = min(x, total - 1);
  const int chunk = static_cast<int>(x % kChunks);
  x /= kChunks;
  const int g = static_cast<int>(x % p.shape.group);
  x /= p.shape.group;
  const int t = static_cast<int>(x % tokens);
  const int64_t bp = x / tokens;
  const int b = static_cast<int>(bp / p.shape.proxy_heads),
            head = static_cast<int>(bp % p.shape.proxy_heads) * p.shape.group + g;
  const int i = p.chunk.begin + t;

  // The rows of the tile path's tiles have their results already (no partials).
  const bool listed = p.tile_count && __ldg(p.tile_count + bp * p.shape.num_blocks + i / 128) > 0;
  const uint64_t slots =
      valid_slots<kChunks>(p.indices + p.shape.query_row(bp, i) * p.shape.top_k, p.shape.top_k,
                           i / 128, __ldg(p.doc_start + int64_t(b) * p.shape.seqlen + i) / 128,
                           chunk) &
      (listed ? 0 : ~uint64_t(0));
  const int64_t ce0 = (bp * p.chunk.tokens + t) * p.shape.top_k;  // chunk-local edge of slot 0
  float w[64 / kChunks], v_proxy[64 / kChunks];
  const float lse2 =
      merge_lse2<kChunks>(p.lse_part + ce0 * p.shape.group + g, p.shape.group, slots, chunk, w);
  const float lse_p2 = merge_lse2<kChunks>(p.lse_p_part + ce0, 1, slots, chunk, v_proxy);
#pragma unroll
  for (int j = 0; j < 64 / kChunks; ++j) w[j] = fast_exp2(w[j] - lse2);  // 0 where not valid

  // Slot k's weight from lane k % kChunks of the segment; independent iterations, so that
  // several 16-byte loads are in flight.
  float acc[8] = {};
#pragma unroll
  for (int j = 0; j < 64 / kChunks; ++j) {
    if (kChunks * j >= p.shape.top_k) break;
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int k = kChunks * j + u;
      const float wk = __shfl_sync(0xffffffffu, w[j], u, kChunks);
      if (!((slots >> k) & 1)) continue;
      const uint4 v = reinterpret_cast<const uint4*>(static_cast<const T*>(p.o_part) +
                                                     ((ce0 + k) * p.shape.group + g) * kD)[chunk];
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = Elem<T>::unpack(words[e]);
        acc[2 * e] += wk * f.x;
        acc[2 * e + 1] += wk * f.y;
      }
    }
  }
  if (!live || listed) return;
  T* out = static_cast<T*>(p.out.data) + b * p.out.stride_b + head * p.out.stride_h +
           p.shape.query_at(i) * p.out.stride_s + fragment_column(chunk);
#pragma unroll
  for (int e = 0; e < 4; ++e)
    *reinterpret_cast<uint32_t*>(out + 8 * e) = Elem<T>::pack(acc[2 * e], acc[2 * e + 1]);
  if (chunk == 0) p.lse[p.shape.query_row(int64_t(b) * p.shape.heads + head, i)] = lse2 * kLn2;
  if (chunk == 0 && g == 0) p.lse_proxy[p.shape.query_row(bp, i)] = lse_p2 * kLn2;
}

}  // namespace flash_msa::cuda::passes::merge

namespace flash_msa::cuda::passes {

template <class T, int kD>
void launch_merge(const MergeParams& params, cudaStream_t stream) {
  const int64_t threads = int64_t(params.shape.batch) * params.shape.proxy_heads *
                          (params.chunk.end - params.chunk.begin) * params.shape.group * (kD / 8);
  merge::merge_kernel<T, kD>
      <<<static_cast<unsigned>((threads + merge::kThreads - 1) / merge::kThreads), merge::kThreads,
         0, stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

#define FLASH_MSA_PASS_DIM(T, D) template void launch_merge<T, D>(const MergeParams&, cudaStream_t);
FLASH_MSA_HEAD_DIMS(FLASH_MSA_PASS_DIM, __nv_bfloat16)
FLASH_MSA_HEAD_DIMS(FLASH_MSA_PASS_DIM, __half)

}  // namespace flash_msa::cuda::passes
