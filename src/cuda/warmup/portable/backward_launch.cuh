// Launch sequence of the portable backward for one (dtype, D, Dp); included by the per-dtype
// instantiation files.
#pragma once

#include <algorithm>

#include "cuda/common/instantiate.h"
#include "cuda/warmup/portable/backward_kernel.cuh"

namespace flash_msa::cuda::portable {

template <class T, int kD, int kDp>
void launch_backward_reduce(const BackwardKernelParams& p, cudaStream_t stream) {
  using namespace backward;
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = 1 << 16;  // grid-stride loops cover the rest
  const int64_t items = int64_t(p.shape.batch) * p.shape.seqlen *
                        ((p.shape.heads / p.shape.kv_group) * (kD / 8) +
                         (p.shape.proxy_heads / p.shape.proxy_group) * (kDp / 8));
  const int64_t reduce_blocks = std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks);
  reduce_kernel<T, kD, kDp><<<static_cast<unsigned>(reduce_blocks), kThreads, 0, stream>>>(p);
  FLASH_MSA_CHECK_LAUNCH();
}

template <class T, int kD, int kDp>
void launch_backward(const BackwardKernelParams& p, cudaStream_t stream) {
  using namespace backward;
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = 1 << 16;  // grid-stride loops cover the rest
  const int64_t rows = int64_t(p.shape.batch) * p.shape.heads * p.shape.queries;
  const int64_t delta_blocks =
      std::min<int64_t>((rows + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks);
  delta_kernel<T, kD><<<static_cast<unsigned>(delta_blocks), kThreads, 0, stream>>>(p);
  FLASH_MSA_CHECK_LAUNCH();

  constexpr int kDqSmem = DqConfig<kD, kDp>::kSmemBytes;
  FLASH_MSA_CUDA_CHECK(cudaFuncSetAttribute(dq_kernel<T, kD, kDp>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, kDqSmem));
  const dim3 dq_grid((p.shape.queries + kDqWarps - 1) / kDqWarps, p.shape.proxy_heads,
                     p.shape.batch);
  dq_kernel<T, kD, kDp><<<dq_grid, kDqWarps * 32, kDqSmem, stream>>>(p);
  FLASH_MSA_CHECK_LAUNCH();

  constexpr int kKvSmem = KvConfig<kD, kDp>::kSmemBytes;
  FLASH_MSA_CUDA_CHECK(cudaFuncSetAttribute(dkv_kernel<T, kD, kDp>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, kKvSmem));
  const dim3 kv_grid(p.shape.num_blocks, p.shape.proxy_heads, p.shape.batch);
  dkv_kernel<T, kD, kDp><<<kv_grid, kKvThreads, kKvSmem, stream>>>(p);
  FLASH_MSA_CHECK_LAUNCH();

  launch_backward_reduce<T, kD, kDp>(p, stream);
}

}  // namespace flash_msa::cuda::portable

// One explicit instantiation for element type T (FLASH_MSA_INSTANTIATE, common/instantiate.h).
#define FLASH_MSA_WARMUP_BACKWARD_DIM(T, D, DP)                                       \
  template void launch_backward<T, D, DP>(const BackwardKernelParams&, cudaStream_t); \
  template void launch_backward_reduce<T, D, DP>(const BackwardKernelParams&, cudaStream_t);
