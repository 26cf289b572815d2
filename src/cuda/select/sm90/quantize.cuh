// The FP8 quantisation of the proxy select (SelectPrecision::kFloat8E4M3, msa.h): token rows of
// Dp = 128 channels to E4M3 with one scale per row (e4m3_scale, common/fp8.h; x / scale rounded
// to nearest even and saturated by the hardware conversion), as common/fp8.h does on the host,
// bit for bit.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8.h"
#include "cuda/select/sm90/select_sm90.h"

namespace flash_msa::cuda::sm90 {

inline constexpr int kQuantizeThreads = 256;  // 8 rows per CTA, one warp each

// Warp w of the grid quantises row w: lane l takes channels 4 l .. 4 l + 3.
template <class T>
__global__ void __launch_bounds__(kQuantizeThreads) quantize_kernel(const QuantizeParams p) {
  const int64_t row = (int64_t(blockIdx.x) * kQuantizeThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const int64_t s = row % p.padded, bh = row / p.padded;
  float x[4] = {0.f, 0.f, 0.f, 0.f};
  if (s < p.tokens) {
    const T* src = static_cast<const T*>(p.in.data) + (bh / p.heads) * p.in.stride_b +
                   (bh % p.heads) * p.in.stride_h + s * p.in.stride_s + 4 * lane;
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = static_cast<float>(v[c]);
  }
  float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, m));
  const float scale = e4m3_scale(amax);
  uint32_t packed = 0;
#pragma unroll
  for (int c = 0; c < 4; c += 2) {
    const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(
        make_float2(__fdiv_rn(x[c], scale), __fdiv_rn(x[c + 1], scale)), __NV_SATFINITE, __NV_E4M3);
    packed |= uint32_t(two) << (8 * c);
  }
  reinterpret_cast<uint32_t*>(p.out + row * kSelectFp8Dp)[lane] = packed;
  if (p.scales && lane == 0) p.scales[row] = scale;
}

template <class T>
void launch_quantize(const QuantizeParams& params, cudaStream_t stream) {
  constexpr int kRowsPerCta = kQuantizeThreads / 32;
  const int64_t ctas = (params.rows + kRowsPerCta - 1) / kRowsPerCta;
  quantize_kernel<T><<<static_cast<unsigned>(ctas), kQuantizeThreads, 0, stream>>>(params);
}

}  // namespace flash_msa::cuda::sm90
