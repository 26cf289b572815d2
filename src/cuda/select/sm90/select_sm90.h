// Launcher of the Hopper proxy-select kernel (select_kernel.cuh), instantiated per dtype for
// Dp = 64 and 128 (select.cu). Takes the portable kernel's parameters and writes the same
// indices; the host entry launches it where select_kernels() says kHopper (cuda.h).
#pragma once

#include <cuda_runtime.h>

#include "cuda/select/portable/select_portable.h"

namespace flash_msa::cuda::sm90 {

template <class T, int kDp>
void launch_select(const portable::SelectKernelParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
