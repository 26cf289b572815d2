// Host-side CUDA error checks: every runtime call and every launch goes through these.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace flash_msa::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw std::runtime_error(std::string("flash_msa: CUDA error at ") + file + ":" +
                           std::to_string(line) + " (" + what + "): " + cudaGetErrorString(err));
}

}  // namespace flash_msa::cuda

#define FLASH_MSA_CUDA_CHECK(expr)                                                    \
  do {                                                                                \
    cudaError_t flash_msa_err_ = (expr);                                              \
    if (flash_msa_err_ != cudaSuccess)                                                \
      ::flash_msa::cuda::throw_cuda_error(flash_msa_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: reports configuration errors without synchronising.
#define FLASH_MSA_CHECK_LAUNCH() FLASH_MSA_CUDA_CHECK(cudaGetLastError())
