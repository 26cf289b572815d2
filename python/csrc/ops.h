// Torch entry points of flash_msa._C: at::Tensor in, at::Tensor out. They turn tensors into the
// params structs of include/flash_msa/msa.h, allocate every output (and the CUDA workspace) with
// torch, and dispatch to flash_msa::cpu or flash_msa::cuda by device. The Python package wraps
// them as torch custom ops (python/flash_msa/ops.py); shapes are checked there first, with
// clearer messages, and again here so that a direct call cannot pass a bad view to a kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace flash_msa::torch_ext {

// Every op takes `query_offset`: the query-side tensors (qp, q, out, dout, lse, lse_proxy,
// indices) hold Sq tokens at positions query_offset .. query_offset + Sq - 1 of the S tokens of
// the key-side tensors (kp, k, v); Sq = S with offset 0 is the whole sequence (Problem in
// include/flash_msa/msa.h).

// Proxy selection. qp [B, Hp, Sq, Dp], kp [B, Hpk, S, Dp] -> indices int32
// [B, Hp, Sq, top_k_blocks] (blocks of 128 keys ascending, -1 padding). fp8: rank on FP8 E4M3
// scores (SelectPrecision::kFloat8E4M3) instead of the exact ones.
at::Tensor select(const at::Tensor& qp, const at::Tensor& kp, int64_t top_k_blocks,
                  double proxy_scale, const std::optional<at::Tensor>& cu_seqlens,
                  int64_t query_offset, bool fp8);

// The kernels each part of a call on CUDA tensors runs, in order: (stage, variant, reason), as
// cuda::explain reports them for the current device.
std::vector<std::tuple<std::string, std::string, std::string>> explain(
    const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& q, const at::Tensor& k,
    int64_t top_k_blocks, bool warmup, bool kl_value_in_forward, bool fp8, int64_t query_offset);

// Checks block indices made outside the library, [B, Hp, Sq, K] int32, against a sequence of
// `seqlen` tokens (and cu_seqlens): the CPU backend's rule on either device, the same error
// (ValueError) naming the batch, proxy head, query and value. On CUDA it waits for the device.
void check_indices(const at::Tensor& indices, const std::optional<at::Tensor>& cu_seqlens,
                   int64_t seqlen, int64_t query_offset);

// Forward of both branches: sparse over `indices`, or dense (warmup) when `indices` is absent.
// Returns out [B, Sq, H*D] (token-major, as Flash-MSA), kl (0-dim: the KL value when
// compute_kl, else 0), lse [B, H, Sq] and lse_proxy [B, Hp, Sq]; the last two exist for the
// backward. The statistics kl, lse, lse_proxy are fp32, or float64 for float64 inputs (CPU).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& indices, double scale,
    double proxy_scale, const std::optional<at::Tensor>& cu_seqlens, bool compute_kl,
    int64_t query_offset);

// Backward over the cached selection (or dense when `indices` is absent). dout [B, Sq, H*D] is
// the gradient of out; kl_grad (one element, may be absent: weight 0) that of kl, read on the
// device. Returns dqp, dkp, dq, dk, dv shaped like their inputs. Every path is deterministic:
// the gradients are bitwise reproducible (on the CPU for a fixed thread count). kl_out (0-dim,
// the statistics' dtype, may be absent) receives the KL value from the backward's teacher.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const std::optional<at::Tensor>& kl_grad, const at::Tensor& qp,
    const at::Tensor& kp, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& lse_proxy,
    const std::optional<at::Tensor>& indices, double scale, double proxy_scale,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& kl_out,
    int64_t query_offset);

// True when this build holds the CUDA kernels (FLASH_MSA_WITH_CUDA).
bool built_with_cuda();

}  // namespace flash_msa::torch_ext
