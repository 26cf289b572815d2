// Host entry of the proxy select stage (SPEC section 1): validation, the CUDA backend's own
// limits, and dispatch on dtype and proxy head dim to the Hopper kernel (select/sm90) where
// select_kernels() says so, to the portable kernel otherwise; the FP8 select
// (SelectPrecision::kFloat8E4M3) quantises into the workspace and runs the Hopper kernel. The
// Hopper kernel's cut key walks (short sequences, sm90::select_parts) keep their lists in the
// workspace too.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <string>

#include "cuda/host/impl.h"
#include "cuda/host/limits.h"
#include "cuda/host/plan.h"
#include "cuda/host/variants.h"
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

// The FP8 select's arrays: the E4M3 copies of qp and kp and the keys' scales, key rows padded
// to whole blocks.
struct Fp8Buffers {
  uint8_t* qp;       // [B, Hp, Sq, 128]
  uint8_t* kp;       // [B, Hpk, NB * 128, 128]
  float* key_scale;  // [B, Hpk, NB * 128]
};

int64_t padded_keys(const Problem& pr) {
  return (pr.seqlen + kBlockSize - 1) / kBlockSize * kBlockSize;
}

// The workspace: with FP8 its buffers, then with parts > 1 the parts' lists and a counter per
// walk (`walks` of them).
auto layout(const Problem& pr, bool fp8, int parts, int64_t walks, Fp8Buffers* fp8_out = nullptr,
            sm90::SelectParts* parts_out = nullptr) {
  return [&pr, fp8, parts, walks, fp8_out, parts_out](Carver& c) {
    if (fp8) {
      const int64_t keys = pr.batch * pr.proxy_kv_heads * padded_keys(pr);
      Fp8Buffers f{};
      f.qp = c.take<uint8_t>(pr.batch * pr.proxy_heads * pr.queries() * sm90::kSelectFp8Dp);
      f.kp = c.take<uint8_t>(keys * sm90::kSelectFp8Dp);
      f.key_scale = c.take<float>(keys);
      if (fp8_out) *fp8_out = f;
    }
    if (parts > 1) {
      const int64_t rows = pr.batch * pr.proxy_heads * pr.queries();
      sm90::SelectParts p{.count = parts};
      p.entries = c.take<int2>(rows * parts * pr.top_k);
      p.fills = c.take<int32_t>(rows * parts);
      p.done = c.take<uint32_t>(walks);
      if (parts_out) *parts_out = p;
    }
  };
}

portable::SelectKernelParams kernel_params(const SelectParams& params) {
  const Problem& pr = params.problem;
  return {
      .qp = params.qp,
      .kp = params.kp,
      .indices = params.indices,
      .cu_seqlens = pr.cu_seqlens,
      .shape = kernel_shape(pr),
  };
}

// Whether the Hopper kernel runs (FP8 runs only there: select_variant throws where it cannot).
bool runs_hopper(const SelectParams& params) {
  const bool fp8 = params.precision == SelectPrecision::kFloat8E4M3;
  return select_variant(params.problem, fp8, current_chip()).kernels == Kernels::kHopper;
}

// The Hopper kernel's parts per key walk, 1 on the portable kernel.
int parts_of(const SelectParams& params, const portable::SelectKernelParams& kp) {
  return runs_hopper(params) ? sm90::select_parts(kp) : 1;
}

// E4M3 copies of `view` ([B, heads, tokens, 128]) into `out` ([B, heads, padded, 128]) and,
// where `scales`, the rows' scales.
template <class T>
void quantize(const ConstView& view, int64_t batch, int64_t heads, int64_t tokens, int64_t padded,
              uint8_t* out, float* scales, cudaStream_t stream) {
  sm90::launch_quantize<T>({.in = view,
                            .out = out,
                            .scales = scales,
                            .rows = batch * heads * padded,
                            .heads = static_cast<int>(heads),
                            .tokens = static_cast<int>(tokens),
                            .padded = static_cast<int>(padded)},
                           stream);
}

template <class T>
void select_fp8(const SelectParams& params, portable::SelectKernelParams kp, const Fp8Buffers& f,
                const sm90::SelectParts& parts, cudaStream_t stream) {
  const Problem& pr = params.problem;
  const int64_t dp = sm90::kSelectFp8Dp, sq = pr.queries(), keys = padded_keys(pr);
  quantize<T>(params.qp, pr.batch, pr.proxy_heads, sq, sq, f.qp, nullptr, stream);
  quantize<T>(params.kp, pr.batch, pr.proxy_kv_heads, pr.seqlen, keys, f.kp, f.key_scale, stream);
  kp.qp = contiguous_view<const void>(f.qp, pr.proxy_heads, sq, dp);
  kp.kp = contiguous_view<const void>(f.kp, pr.proxy_kv_heads, keys, dp);
  kp.key_scales = f.key_scale;
  sm90::launch_select<__nv_fp8_e4m3, sm90::kSelectFp8Dp>(kp, parts, stream);
}

// The Hopper kernel where `hopper` (instantiated for Dp = 64 and 128), else the portable one.
template <class T, int kDp>
void launch(const portable::SelectKernelParams& kp, bool hopper, const sm90::SelectParts& parts,
            cudaStream_t stream) {
  if constexpr (kDp != 32) {
    if (hopper) return sm90::launch_select<T, kDp>(kp, parts, stream);
  }
  portable::launch_select<T, kDp>(kp, stream);
}

template <class T>
void dispatch_dp(const portable::SelectKernelParams& kp, int64_t dp, bool hopper,
                 const sm90::SelectParts& parts, cudaStream_t stream) {
  switch (dp) {
    case 32:
      launch<T, 32>(kp, hopper, parts, stream);
      break;
    case 64:
      launch<T, 64>(kp, hopper, parts, stream);
      break;
    default:
      launch<T, 128>(kp, hopper, parts, stream);
      break;
  }
}

}  // namespace

size_t select_workspace_bytes(const SelectParams& params) {
  validate(params);
  // The top-K lists live in shared memory but for cut walks; the FP8 select needs its
  // quantised copies.
  const portable::SelectKernelParams kp = kernel_params(params);
  return layout_bytes(layout(params.problem, params.precision == SelectPrecision::kFloat8E4M3,
                             parts_of(params, kp), sm90::select_walks(kp)));
}

void select(const SelectParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params);
  check_limits(params);
  const Problem& pr = params.problem;
  const portable::SelectKernelParams kp = kernel_params(params);
  const bool fp8 = params.precision == SelectPrecision::kFloat8E4M3;
  const bool hopper = runs_hopper(params);  // FP8: the checks of select_variant
  Fp8Buffers f{};
  sm90::SelectParts parts{};
  const int count = parts_of(params, kp);
  if (fp8 || count > 1)
    carve_workspace(workspace, layout(pr, fp8, count, sm90::select_walks(kp), &f, &parts),
                    "select_workspace_bytes");
  if (fp8) {
    if (pr.dtype == DType::kBFloat16)
      select_fp8<__nv_bfloat16>(params, kp, f, parts, stream);
    else
      select_fp8<__half>(params, kp, f, parts, stream);
    return;
  }
  if (pr.dtype == DType::kBFloat16) {
    dispatch_dp<__nv_bfloat16>(kp, pr.proxy_head_dim, hopper, parts, stream);
  } else {
    dispatch_dp<__half>(kp, pr.proxy_head_dim, hopper, parts, stream);
  }
}

}  // namespace flash_msa::cuda
