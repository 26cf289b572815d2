#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "cuda/common/arch.h"

namespace flash_msa::cuda {

bool hopper_kernels_usable(const void* kernel) {
  const char* portable = std::getenv("FLASH_MSA_PORTABLE_KERNELS");
  if (portable != nullptr && *portable != '\0' && std::strcmp(portable, "0") != 0) return false;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      major != 9) {
    cudaGetLastError();
    return false;
  }
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion == 90;
}

}  // namespace flash_msa::cuda
