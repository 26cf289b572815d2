// Torch entry points of flash_msa._C: at::Tensor in, at::Tensor out. They turn tensors into the
// params structs of include/flash_msa/msa.h, allocate every output (and the CUDA workspace) with
// torch, and dispatch to flash_msa::cpu or flash_msa::cuda by device. The Python package wraps
// them as torch custom ops (python/flash_msa/ops.py); shapes are checked there first, with
// clearer messages, and again here so that a direct call cannot pass a bad view to a kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace flash_msa::torch_ext {

// Proxy selection. qp [B, Hp, S, Dp], kp [B, Hpk, S, Dp] -> indices int32
// [B, Hp, S, top_k_blocks] (blocks of 128 keys ascending, -1 padding).
at::Tensor select(const at::Tensor& qp, const at::Tensor& kp, int64_t top_k_blocks,
                  double proxy_scale, const std::optional<at::Tensor>& cu_seqlens);

// Forward of both branches: sparse over `indices`, or dense (warmup) when `indices` is absent.
// Returns out [B, S, H*D] (token-major, as Flash-MSA), kl (0-dim: the KL value when
// compute_kl, else 0), lse [B, H, S] and lse_proxy [B, Hp, S]; the last two exist for the
// backward. The statistics kl, lse, lse_proxy are fp32, or float64 for float64 inputs (CPU).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& indices, double scale,
    double proxy_scale, const std::optional<at::Tensor>& cu_seqlens, bool compute_kl);

// Backward over the cached selection (or dense when `indices` is absent). dout [B, S, H*D] is
// the gradient of out; kl_grad (one element, may be absent: weight 0) that of kl, read on the
// device. Returns dqp, dkp, dq, dk, dv shaped like their inputs. Every path is deterministic:
// the gradients are bitwise reproducible (on the CPU for a fixed thread count). kl_out (0-dim,
// the statistics' dtype, may be absent) receives the KL value from the backward's teacher.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const std::optional<at::Tensor>& kl_grad, const at::Tensor& qp,
    const at::Tensor& kp, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& lse_proxy,
    const std::optional<at::Tensor>& indices, double scale, double proxy_scale,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& kl_out);

// True when this build holds the CUDA kernels (FLASH_MSA_WITH_CUDA).
bool built_with_cuda();

}  // namespace flash_msa::torch_ext
