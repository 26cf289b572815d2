// The KL value (SPEC section 3) from per-block terms: the sparse path's per-row sums over the
// valid slots, then a fixed-order reduction of the per-(b, p, i) terms to the scalar loss.
#include "cuda/host/check.h"
#include "cuda/passes/passes.h"
#include "cuda/schedule/edges.cuh"

namespace flash_msa::cuda::passes {
namespace {

constexpr int kReduceThreads = 1024;
constexpr int kRowThreads = 256;

// kl_rows[b, p, i] = sum over the valid slots of the token's KL terms, in slot order.
__global__ void __launch_bounds__(kRowThreads) kl_rows_kernel(const MergeParams p) {
  const int tokens = p.chunk.end - p.chunk.begin;
  const int64_t x = int64_t(blockIdx.x) * kRowThreads + threadIdx.x;
  if (x >= int64_t(p.shape.batch) * p.shape.proxy_heads * tokens) return;
  const int t = static_cast<int>(x % tokens);
  const int64_t bp = x / tokens;
  const int b = static_cast<int>(bp / p.shape.proxy_heads), i = p.chunk.begin + t;
  const uint64_t slots =
      schedule::valid_slots(p.indices + p.shape.query_row(bp, i) * p.shape.top_k, p.shape.top_k,
                            i / 128, __ldg(p.doc_start + int64_t(b) * p.shape.seqlen + i) / 128);
  const float* part = p.kl_part + (bp * p.chunk.tokens + t) * p.shape.top_k;
  float kl = 0.f;
  for (uint64_t s = slots; s; s &= s - 1) kl += part[__ffsll(s) - 1];
  p.kl_rows[p.shape.query_row(bp, i)] = kl;
}

// One CTA: thread t sums slots t, t + 1024, ... in order (fp64), then a fixed tree; the result
// does not depend on scheduling, so repeated runs give the same bits.
__global__ void __launch_bounds__(kReduceThreads)
    kl_reduce_kernel(const float* __restrict__ partial, int64_t n, double inv_rows,
                     float* __restrict__ kl) {
  __shared__ double sums[kReduceThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kReduceThreads) acc += partial[i];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) sums[threadIdx.x] += sums[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) *kl = static_cast<float>(sums[0] * inv_rows);
}

}  // namespace

void launch_kl_rows(const MergeParams& params, cudaStream_t stream) {
  const int64_t threads = int64_t(params.shape.batch) * params.shape.proxy_heads *
                          (params.chunk.end - params.chunk.begin);
  kl_rows_kernel<<<static_cast<unsigned>((threads + kRowThreads - 1) / kRowThreads), kRowThreads, 0,
                   stream>>>(params);
  FLASH_MSA_CHECK_LAUNCH();
}

void launch_kl_reduce(const float* partial, const KernelShape& shape, float* kl,
                      cudaStream_t stream) {
  launch_kl_sum(partial, int64_t(shape.batch) * shape.proxy_heads * shape.queries, shape, kl,
                stream);
}

void launch_kl_sum(const float* partial, int64_t count, const KernelShape& shape, float* kl,
                   cudaStream_t stream) {
  const int64_t rows = int64_t(shape.batch) * shape.proxy_heads;
  kl_reduce_kernel<<<1, kReduceThreads, 0, stream>>>(partial, count,
                                                     1.0 / (double(rows) * shape.seqlen), kl);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::passes
