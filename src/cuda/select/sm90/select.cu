// Hopper proxy-select instantiations (Dp = 64, 128; FP8 at 128), the FP8 quantisation, the
// part count of cut key walks and the probe of their sm_90a code.
#include <algorithm>

#include "cuda/select/sm90/quantize.cuh"
#include "cuda/select/sm90/select_kernel.cuh"

namespace flash_msa::cuda::sm90 {

#define FLASH_MSA_SELECT_SM90(T, DP)                                                      \
  template void launch_select<T, DP>(const portable::SelectKernelParams&, const SelectParts&, \
                                     cudaStream_t);
FLASH_MSA_SELECT_SM90(__nv_bfloat16, 64)
FLASH_MSA_SELECT_SM90(__nv_bfloat16, 128)
FLASH_MSA_SELECT_SM90(__half, 64)
FLASH_MSA_SELECT_SM90(__half, 128)
FLASH_MSA_SELECT_SM90(__nv_fp8_e4m3, 128)
#undef FLASH_MSA_SELECT_SM90
template void launch_quantize<__nv_bfloat16>(const QuantizeParams&, cudaStream_t);
template void launch_quantize<__half>(const QuantizeParams&, cudaStream_t);

int64_t select_walks(const portable::SelectKernelParams& params) {
  return portable::select_grid<block_select::kTiles>(params);
}

int select_parts(const portable::SelectKernelParams& params) {
  constexpr int64_t kFillCtas = 3 * 132;  // three waves of a 132-SM H100 / H200
  constexpr int kMinPartBlocks = 8;
  const int64_t ctas = select_walks(params);
  if (ctas == 0) return 1;
  const int walk = (params.shape.query_offset + params.shape.queries - 1) / portable::kBlockKeys + 1;
  const int by_ctas = static_cast<int>((kFillCtas + ctas - 1) / ctas);
  return std::clamp(std::min(by_ctas, walk / kMinPartBlocks), 1, kMaxSelectParts);
}

bool select_built() {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, block_select::select_kernel<__nv_bfloat16, 128>) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion == 90;
}

}  // namespace flash_msa::cuda::sm90
