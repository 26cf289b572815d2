// Dispatch of the main-attention entries (forward, backward, warmup) on dtype and (D, Dp) to the
// kernels instantiated for them (FLASH_MSA_ATTENTION_DIMS, common/instantiate.h): the pairs
// supported_attention_dims accepts (limits.h), which the caller has checked.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/instantiate.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda {

// Calls launch.template operator()<T, kD, kDp>() for the element type of `dtype` (bf16 or fp16)
// and the instantiated (kD, kDp) equal to (d, dp).
template <class Launch>
void dispatch_attention(DType dtype, int64_t d, int64_t dp, const Launch& launch) {
  auto dims = [&]<class T>() {
#define FLASH_MSA_CASE(T_, D, DP) \
  if (d == D && dp == DP) return launch.template operator()<T, D, DP>();
    FLASH_MSA_ATTENTION_DIMS(FLASH_MSA_CASE, )
#undef FLASH_MSA_CASE
  };
  if (dtype == DType::kBFloat16) {
    dims.template operator()<__nv_bfloat16>();
  } else {
    dims.template operator()<__half>();
  }
}

}  // namespace flash_msa::cuda
