// Which implementation the sparse passes and select take (flash_msa::cuda::sparse_kernels,
// select_kernels): the Hopper kernels on compute capability 9.x at D = 128 (select: Dp = 64 or
// 128), the portable ones otherwise or when FLASH_MSA_PORTABLE_KERNELS asks for them, so that
// the tests of each path know which one ran.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "cuda/cuda_test_util.h"

namespace flash_msa::test {
namespace {

Problem paper_problem(int64_t head_dim) {
  return {.batch = 1,
          .seqlen = 4096,
          .heads = 64,
          .kv_heads = 4,
          .proxy_heads = 4,
          .proxy_kv_heads = 1,
          .head_dim = head_dim,
          .proxy_head_dim = 128,
          .top_k = 16,
          .scale = 0.088f,
          .proxy_scale = 0.088f,
          .dtype = DType::kBFloat16};
}

bool hopper_device() {
  int device = 0, major = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  return major == 9;
}

using CudaSparseKernels = CudaTest;

TEST_F(CudaSparseKernels, HopperAtD128OnComputeCapability9) {
  const cuda::Kernels expected =
      hopper_device() ? cuda::Kernels::kHopper : cuda::Kernels::kPortable;
  EXPECT_EQ(cuda::sparse_kernels(paper_problem(128)), expected);
  EXPECT_STREQ(cuda::kernels_name(expected), hopper_device() ? "hopper" : "portable");
  // Asked twice: the cached probe answers the same.
  EXPECT_EQ(cuda::sparse_kernels(paper_problem(128)), expected);
}

TEST_F(CudaSparseKernels, PortableBelowD128) {
  for (const int64_t d : {32, 64})
    EXPECT_EQ(cuda::sparse_kernels(paper_problem(d)), cuda::Kernels::kPortable);
}

TEST_F(CudaSparseKernels, EnvironmentForcesPortable) {
  {
    const PortableKernels portable;
    EXPECT_EQ(cuda::sparse_kernels(paper_problem(128)), cuda::Kernels::kPortable);
  }
  // "0" leaves the choice to the device.
  setenv("FLASH_MSA_PORTABLE_KERNELS", "0", 1);
  EXPECT_EQ(cuda::sparse_kernels(paper_problem(128)),
            hopper_device() ? cuda::Kernels::kHopper : cuda::Kernels::kPortable);
  unsetenv("FLASH_MSA_PORTABLE_KERNELS");
}

// Select (flash_msa::cuda::select_kernels): the Hopper kernel at Dp = 64 and 128 whatever D is,
// the portable one at Dp = 32 or when the environment asks for it.
using CudaSelectKernels = CudaTest;

TEST_F(CudaSelectKernels, HopperAtDp64And128OnComputeCapability9) {
  const cuda::Kernels expected =
      hopper_device() ? cuda::Kernels::kHopper : cuda::Kernels::kPortable;
  for (const int64_t dp : {64, 128}) {
    Problem pr = paper_problem(64);
    pr.proxy_head_dim = dp;
    EXPECT_EQ(cuda::select_kernels(pr), expected) << dp;
  }
  Problem pr = paper_problem(128);
  pr.proxy_head_dim = 32;
  EXPECT_EQ(cuda::select_kernels(pr), cuda::Kernels::kPortable);
  const PortableKernels portable;
  EXPECT_EQ(cuda::select_kernels(paper_problem(128)), cuda::Kernels::kPortable);
}

}  // namespace
}  // namespace flash_msa::test
