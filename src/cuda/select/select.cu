// Host entry of the proxy select stage (SPEC section 1): validation, the CUDA backend's own
// limits, and dispatch on dtype and proxy head dim to the Hopper kernel (select/sm90) where
// select_kernels() says so, to the portable kernel otherwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "cuda/host/impl.h"
#include "cuda/host/limits.h"
#include "cuda/host/plan.h"
#include "cuda/select/portable/select_portable.h"
#include "cuda/select/sm90/select_sm90.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

void check_limits(const SelectParams& params) {
  const Problem& pr = params.problem;
  check_dtype(pr);
  if (pr.proxy_head_dim != 32 && pr.proxy_head_dim != 64 && pr.proxy_head_dim != 128)
    limit_error("proxy_head_dim", "32, 64 or 128", std::to_string(pr.proxy_head_dim));
  if (pr.top_k > portable::kMaxTopK)
    limit_error("top_k", "at most " + std::to_string(portable::kMaxTopK) + " blocks",
                std::to_string(pr.top_k));
  check_token_count(pr);
  const int64_t tiles = (pr.seqlen + kBlockSize - 1) / kBlockSize;
  if (tiles * pr.batch * pr.proxy_heads > kInt32Max)
    limit_error("proxy_heads", "batch * proxy_heads * ceil(seqlen / 128) below 2^31",
                std::to_string(tiles * pr.batch * pr.proxy_heads));
  check_vector_view("qp", params.qp);
  check_vector_view("kp", params.kp);
}

// The Hopper kernel where `hopper` (instantiated for Dp = 64 and 128), else the portable one.
template <class T, int kDp>
void launch(const portable::SelectKernelParams& kp, bool hopper, cudaStream_t stream) {
  if constexpr (kDp != 32) {
    if (hopper) return sm90::launch_select<T, kDp>(kp, stream);
  }
  portable::launch_select<T, kDp>(kp, stream);
}

template <class T>
void dispatch_dp(const portable::SelectKernelParams& kp, int64_t dp, bool hopper,
                 cudaStream_t stream) {
  switch (dp) {
    case 32:
      launch<T, 32>(kp, hopper, stream);
      break;
    case 64:
      launch<T, 64>(kp, hopper, stream);
      break;
    default:
      launch<T, 128>(kp, hopper, stream);
      break;
  }
}

}  // namespace

size_t select_workspace_bytes(const SelectParams& params) {
  validate(params);
  return 0;  // the top-K lists live in shared memory
}

void select(const SelectParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params);
  check_limits(params);
  const Problem& pr = params.problem;
  const portable::SelectKernelParams kp{
      .qp = params.qp,
      .kp = params.kp,
      .indices = params.indices,
      .cu_seqlens = pr.cu_seqlens,
      .shape = kernel_shape(pr),
  };
  const bool hopper = select_kernels(pr) == Kernels::kHopper;
  if (pr.dtype == DType::kBFloat16) {
    dispatch_dp<__nv_bfloat16>(kp, pr.proxy_head_dim, hopper, stream);
  } else {
    dispatch_dp<__half>(kp, pr.proxy_head_dim, hopper, stream);
  }
}

}  // namespace flash_msa::cuda
