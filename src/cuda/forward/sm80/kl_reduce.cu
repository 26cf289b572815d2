// Fixed-order reduction of the per-(b, p, i) KL terms to the scalar loss (SPEC section 3).
#include "cuda/common/check.h"
#include "cuda/forward/sm80/forward_sm80.h"

namespace flash_msa::cuda::sm80 {
namespace {

constexpr int kReduceThreads = 1024;

// One CTA: thread t sums slots t, t + 1024, ... in order (fp64), then a fixed tree; the result
// does not depend on scheduling, so repeated runs give the same bits.
__global__ void __launch_bounds__(kReduceThreads)
    kl_reduce_kernel(const float* __restrict__ partial, int64_t n, float* __restrict__ kl) {
  __shared__ double sums[kReduceThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kReduceThreads) acc += partial[i];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) sums[threadIdx.x] += sums[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) *kl = static_cast<float>(sums[0] / static_cast<double>(n));
}

}  // namespace

void launch_kl_reduce(const float* partial, int64_t n, float* kl, cudaStream_t stream) {
  kl_reduce_kernel<<<1, kReduceThreads, 0, stream>>>(partial, n, kl);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::sm80
