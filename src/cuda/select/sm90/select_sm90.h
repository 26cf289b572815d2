// Launcher of the Hopper proxy-select kernel (select_kernel.cuh), instantiated per dtype for
// Dp = 64 and 128 and for FP8 E4M3 at Dp = 128 (select.cu). Takes the portable kernel's
// parameters and writes the same indices; the host entry launches it where select_kernels()
// says kHopper (cuda.h). The FP8 select (SelectPrecision::kFloat8E4M3) first quantises q_proxy
// and k_proxy (quantize.cuh) into the workspace.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/select/portable/select_portable.h"

namespace flash_msa::cuda::sm90 {

template <class T, int kDp>
void launch_select(const portable::SelectKernelParams& params, cudaStream_t stream);

inline constexpr int kSelectFp8Dp = 128;  // the one proxy head dim of the FP8 select

struct QuantizeParams {
  ConstView in;        // [B, H, tokens, 128] strided, 8-byte aligned rows
  uint8_t* out;        // [B, H, padded, 128] contiguous E4M3; rows past `tokens` zero
  float* scales;       // [B, H, padded] contiguous, 1 past `tokens`; null: not written
  int64_t rows;        // B * H * padded
  int heads;           // H
  int tokens, padded;  // rows of `in` per (b, h); rows of `out` per (b, h), >= tokens
};

template <class T>
void launch_quantize(const QuantizeParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
