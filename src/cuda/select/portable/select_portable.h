// Launcher of the portable proxy-select kernel (select_kernel.cuh; parameters in
// select/select_params.h), explicitly instantiated per dtype (select_bf16.cu, select_fp16.cu) for
// the supported proxy head dims.
#pragma once

#include <cuda_runtime.h>

#include "cuda/select/select_params.h"

namespace flash_msa::cuda::portable {

template <class T, int kDp>
void launch_select(const SelectKernelParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::portable
