#include "ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "flash_msa/cpu.h"
#include "flash_msa/msa.h"

#ifdef FLASH_MSA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "flash_msa/cuda.h"
#endif

namespace flash_msa::torch_ext {
namespace {

// Messages are assembled from strings only: this module uses no iostreams (see
// src/common/check.h), so neither TORCH_CHECK nor c10::str, which format through them.
// flash_msa::Error reaches Python as ValueError.
void check_value(bool ok, const std::string& message) {
  if (!ok) throw Error(message);
}

std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t x = 0; x < sizes.size(); ++x) s += (x ? ", " : "") + std::to_string(sizes[x]);
  return s + "]";
}

std::string dtype_str(at::ScalarType t) { return c10::toString(t); }

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble: {
      const std::string kind = t.scalar_type() == at::kFloat ? "float32" : "float64";
      check_value(!t.is_cuda(), std::string("flash_msa: ") + name + ": " + kind +
                                    " runs on the CPU backend only (the CUDA kernels take "
                                    "bfloat16 or float16), got " + kind + " on " +
                                    t.device().str());
      return t.scalar_type() == at::kFloat ? DType::kFloat32 : DType::kFloat64;
    }
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      throw Error(std::string("flash_msa: ") + name +
                  ": expected float32, float64 (CPU only), float16 or bfloat16, got " +
                  dtype_str(t.scalar_type()));
  }
}

// The dtype of the statistics (lse, lse_proxy, kl, kl_grad): float32, or float64 for float64
// inputs, whose CPU backend keeps double precision throughout (include/flash_msa/cpu.h).
at::ScalarType stats_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A statistics tensor as the float* of the params structs; it holds doubles for float64 inputs,
// as the CPU backend expects (include/flash_msa/cpu.h).
float* stats_ptr(const at::Tensor& t) { return static_cast<float*>(t.mutable_data_ptr()); }
const float* const_stats_ptr(const at::Tensor& t) {
  return static_cast<const float*>(t.const_data_ptr());
}

// The C++ views need a unit channel stride and token rows that do not overlap; any other layout
// (an expanded gradient such as that of out.sum(), say) is copied once. Other strides pass
// through, so [B, S, H, D] token-major buffers need no copy.
at::Tensor kernel_layout(const at::Tensor& t, const char* name) {
  check_value(t.dim() == 4, std::string("flash_msa: ") + name + ": expected a 4-D tensor, got " +
                                std::to_string(t.dim()) + "-D");
  const bool fits = t.stride(3) == 1 && t.stride(2) >= t.size(3);
  return fits ? t : t.clone(at::MemoryFormat::Contiguous);
}

ConstView const_view(const at::Tensor& t) {
  return {t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

MutView mut_view(const at::Tensor& t) {
  return {t.mutable_data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

// [B, S, H*D] token-major buffer seen as the logical [B, H, S, D] view of the C++ API.
at::Tensor heads_view(const at::Tensor& t, int64_t heads, int64_t head_dim, const char* name) {
  check_value(t.dim() == 3 && t.size(2) == heads * head_dim,
              std::string("flash_msa: ") + name + ": expected [B, S, " +
                  std::to_string(heads * head_dim) + "], got " + shape_str(t.sizes()));
  return t.unflatten(2, {heads, head_dim}).permute({0, 2, 1, 3});
}

// True for CUDA tensors (after checking that this build can run them), false for CPU tensors.
bool on_cuda(const at::Tensor& t) {
  if (t.is_cuda()) {
#ifndef FLASH_MSA_WITH_CUDA
    throw std::runtime_error(
        "flash_msa was built without CUDA kernels, so it cannot run on " + t.device().str() +
        ". Rebuild with a CUDA toolkit whose major version matches torch's (torch.version.cuda) "
        "on the path and FLASH_MSA_CUDA unset: pip install --no-build-isolation .");
#endif
    return true;
  }
  check_value(t.is_cpu(),
              "flash_msa: tensors must be on the CPU or a CUDA device, got " + t.device().str());
  return false;
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  check_value(t.device() == ref.device(), std::string("flash_msa: ") + name + ": expected device " +
                                              ref.device().str() + ", got " + t.device().str());
}

// Fills the document layout of `problem`; the returned tensor keeps the offsets alive.
at::Tensor set_documents(Problem& problem, const std::optional<at::Tensor>& cu_seqlens,
                         const at::Tensor& ref) {
  if (!cu_seqlens) return {};
  const at::Tensor& cu = *cu_seqlens;
  check_value(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.numel() >= 2,
              "flash_msa: cu_seqlens: expected a 1-D int32 tensor of at least 2 offsets, got " +
                  dtype_str(cu.scalar_type()) + " of shape " + shape_str(cu.sizes()));
  check_same_device(ref, cu, "cu_seqlens");
  at::Tensor contiguous = cu.contiguous();
  problem.cu_seqlens = contiguous.const_data_ptr<int32_t>();
  problem.num_docs = contiguous.numel() - 1;
  return contiguous;
}

// The problem of a full operation; `top_k_blocks` is the number of selected blocks (0 in warmup).
// The queries (q, qp) are the Sq tokens from `query_offset` of the S tokens of the keys (k, kp).
Problem make_problem(const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& q,
                     const at::Tensor& k, int64_t top_k_blocks, double scale, double proxy_scale,
                     int64_t query_offset) {
  check_value(q.size(0) == k.size(0) && kp.size(0) == q.size(0) && qp.size(0) == q.size(0) &&
                  kp.size(2) == k.size(2) && qp.size(2) == q.size(2),
              "flash_msa: expected one batch for every tensor, q_proxy's tokens equal to q's and "
              "k_proxy's to k's; got q_proxy " + shape_str(qp.sizes()) + ", k_proxy " +
                  shape_str(kp.sizes()) + ", q " + shape_str(q.sizes()) + ", k " +
                  shape_str(k.sizes()));
  return {.batch = q.size(0),
          .seqlen = k.size(2),
          .heads = q.size(1),
          .kv_heads = k.size(1),
          .proxy_heads = qp.size(1),
          .proxy_kv_heads = kp.size(1),
          .head_dim = q.size(3),
          .proxy_head_dim = qp.size(3),
          .top_k = top_k_blocks,
          .scale = static_cast<float>(scale),
          .proxy_scale = static_cast<float>(proxy_scale),
          .dtype = dtype_of(q, "q"),
          .query_offset = query_offset,
          .query_len = q.size(2)};
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_same_device(ref, t, name);
  check_value(t.scalar_type() == ref.scalar_type(),
              std::string("flash_msa: ") + name + ": expected dtype " +
                  dtype_str(ref.scalar_type()) + " (that of q), got " + dtype_str(t.scalar_type()));
}

// User- or select-supplied indices [B, Hp, S, K] int32; returns the contiguous copy to keep alive.
at::Tensor checked_indices(const at::Tensor& indices, const at::Tensor& qp) {
  check_value(indices.scalar_type() == at::kInt && indices.dim() == 4 &&
                  indices.size(0) == qp.size(0) && indices.size(1) == qp.size(1) &&
                  indices.size(2) == qp.size(2),
              "flash_msa: indices: expected int32 [" + std::to_string(qp.size(0)) + ", " +
                  std::to_string(qp.size(1)) + ", " + std::to_string(qp.size(2)) + ", K], got " +
                  dtype_str(indices.scalar_type()) + " " + shape_str(indices.sizes()));
  check_same_device(qp, indices, "indices");
  return indices.contiguous();
}

at::Tensor checked_stats(const at::Tensor& t, const at::Tensor& ref, int64_t heads,
                         const char* name) {
  check_value(t.scalar_type() == stats_type(ref) && t.dim() == 3 && t.size(0) == ref.size(0) &&
                  t.size(1) == heads && t.size(2) == ref.size(2),
              std::string("flash_msa: ") + name + ": expected " + dtype_str(stats_type(ref)) +
                  " [" + std::to_string(ref.size(0)) + ", " + std::to_string(heads) + ", " +
                  std::to_string(ref.size(2)) + "], got " + dtype_str(t.scalar_type()) + " " +
                  shape_str(t.sizes()));
  check_same_device(ref, t, name);
  return t.contiguous();
}

#ifdef FLASH_MSA_WITH_CUDA
// Scratch memory from torch's caching allocator; freed when `holder` dies, which is safe right
// after the launches because the allocator reuses it only in stream order.
cuda::Workspace workspace(size_t bytes, const at::Tensor& like, at::Tensor& holder) {
  if (bytes == 0) return {};
  holder = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  return {holder.data_ptr(), bytes};
}
#endif

}  // namespace

at::Tensor select(const at::Tensor& qp_in, const at::Tensor& kp_in, int64_t top_k_blocks,
                  double proxy_scale, const std::optional<at::Tensor>& cu_seqlens,
                  int64_t query_offset, bool fp8) {
  const at::Tensor qp = kernel_layout(qp_in, "q_proxy");
  const at::Tensor kp = kernel_layout(kp_in, "k_proxy");
  check_like(kp, qp, "k_proxy");
  // Selection reads only the proxy branch: the main-head fields mirror the proxy ones so that
  // the shared validation sees a consistent problem.
  Problem problem =
      make_problem(qp, kp, qp, kp, top_k_blocks, proxy_scale, proxy_scale, query_offset);
  const at::Tensor cu = set_documents(problem, cu_seqlens, qp);
  at::Tensor indices = at::empty({qp.size(0), qp.size(1), qp.size(2), top_k_blocks},
                                 qp.options().dtype(at::kInt));
  const SelectParams params{.problem = problem,
                            .qp = const_view(qp),
                            .kp = const_view(kp),
                            .indices = indices.mutable_data_ptr<int32_t>(),
                            .precision = fp8 ? SelectPrecision::kFloat8E4M3
                                             : SelectPrecision::kExact};
  if (on_cuda(qp)) {
#ifdef FLASH_MSA_WITH_CUDA
    const c10::cuda::CUDAGuard guard(qp.device());
    at::Tensor holder;
    cuda::select(params, workspace(cuda::select_workspace_bytes(params), qp, holder),
                 at::cuda::getCurrentCUDAStream());
#endif
  } else {
    cpu::select(params);
  }
  return indices;
}

void check_indices(const at::Tensor& indices_in, const std::optional<at::Tensor>& cu_seqlens,
                   int64_t seqlen, int64_t query_offset) {
  check_value(indices_in.scalar_type() == at::kInt && indices_in.dim() == 4,
              "flash_msa: indices: expected int32 [B, Hp, Sq, K], got " +
                  dtype_str(indices_in.scalar_type()) + " " + shape_str(indices_in.sizes()));
  if (cu_seqlens) check_same_device(indices_in, *cu_seqlens, "cu_seqlens");
  const at::Tensor indices = indices_in.contiguous();
  Problem problem{.batch = indices.size(0),
                  .seqlen = seqlen,
                  .proxy_heads = indices.size(1),
                  .top_k = indices.size(3),
                  .query_offset = query_offset,
                  .query_len = indices.size(2)};
  const at::Tensor cu = set_documents(problem, cu_seqlens, indices);
  const CheckIndicesParams params{.problem = problem,
                                  .indices = indices.const_data_ptr<int32_t>()};
  if (on_cuda(indices)) {
#ifdef FLASH_MSA_WITH_CUDA
    const c10::cuda::CUDAGuard guard(indices.device());
    at::Tensor holder;
    cuda::check_indices(params, workspace(cuda::check_indices_workspace_bytes(), indices, holder),
                        at::cuda::getCurrentCUDAStream());
#endif
  } else {
    validate(params);
    validate_indices_values(problem, problem.cu_seqlens, params.indices);
  }
}

std::vector<std::tuple<std::string, std::string, std::string>> explain(
    const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& q, const at::Tensor& k,
    int64_t top_k_blocks, bool warmup, bool kl_value_in_forward, bool fp8, int64_t query_offset) {
  check_value(on_cuda(q), "flash_msa: explain: expected CUDA tensors (CPU tensors run the C++ "
                          "reference backend), got " + q.device().str());
  std::vector<std::tuple<std::string, std::string, std::string>> out;
#ifdef FLASH_MSA_WITH_CUDA
  const Problem problem = make_problem(qp, kp, q, k, top_k_blocks, 1.0, 1.0, query_offset);
  const c10::cuda::CUDAGuard guard(q.device());
  const cuda::CallOptions options{
      .warmup = warmup, .kl_value_in_forward = kl_value_in_forward, .fp8_select = fp8};
  for (const cuda::StageChoice& c : cuda::explain(problem, options))
    out.emplace_back(c.stage, c.variant, c.reason);
#endif
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& qp_in, const at::Tensor& kp_in, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const std::optional<at::Tensor>& indices_in,
    double scale, double proxy_scale, const std::optional<at::Tensor>& cu_seqlens,
    bool compute_kl, int64_t query_offset) {
  const at::Tensor qp = kernel_layout(qp_in, "q_proxy"), kp = kernel_layout(kp_in, "k_proxy");
  const at::Tensor q = kernel_layout(q_in, "q"), k = kernel_layout(k_in, "k"),
                   v = kernel_layout(v_in, "v");
  check_like(qp, q, "q_proxy");
  check_like(kp, q, "k_proxy");
  check_like(k, q, "k");
  check_like(v, q, "v");
  const bool warmup = !indices_in.has_value();
  const at::Tensor indices = warmup ? at::Tensor() : checked_indices(*indices_in, qp);
  Problem problem = make_problem(qp, kp, q, k, warmup ? 0 : indices.size(3), scale, proxy_scale,
                                 query_offset);
  const at::Tensor cu = set_documents(problem, cu_seqlens, q);

  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const at::Tensor out = at::empty({B, S, H, D}, q.options());
  const at::TensorOptions stats = q.options().dtype(stats_type(q));
  at::Tensor lse = at::empty({B, H, S}, stats);
  at::Tensor lse_proxy = at::empty({B, qp.size(1), S}, stats);
  // Without compute_kl, kl is 0: still the output whose gradient drives the proxy branch.
  at::Tensor kl = compute_kl ? at::empty({}, stats) : at::zeros({}, stats);
  const ForwardParams params{.problem = problem,
                             .indices = warmup ? nullptr : indices.const_data_ptr<int32_t>(),
                             .qp = const_view(qp),
                             .kp = const_view(kp),
                             .q = const_view(q),
                             .k = const_view(k),
                             .v = const_view(v),
                             .out = mut_view(out.permute({0, 2, 1, 3})),
                             .lse = stats_ptr(lse),
                             .lse_proxy = stats_ptr(lse_proxy),
                             .kl = compute_kl ? stats_ptr(kl) : nullptr};
  if (on_cuda(q)) {
#ifdef FLASH_MSA_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    at::Tensor holder;
    const cuda::Workspace ws = workspace(cuda::forward_workspace_bytes(params, warmup), q, holder);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    warmup ? cuda::warmup_forward(params, ws, stream) : cuda::sparse_forward(params, ws, stream);
#endif
  } else {
    warmup ? cpu::warmup_forward(params) : cpu::sparse_forward(params);
  }
  return {out.view({B, S, H * D}), kl, lse, lse_proxy};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout_in, const std::optional<at::Tensor>& kl_grad_in, const at::Tensor& qp_in,
    const at::Tensor& kp_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& lse_proxy_in,
    const std::optional<at::Tensor>& indices_in, double scale, double proxy_scale,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& kl_out,
    int64_t query_offset) {
  const at::Tensor qp = kernel_layout(qp_in, "q_proxy"), kp = kernel_layout(kp_in, "k_proxy");
  const at::Tensor q = kernel_layout(q_in, "q"), k = kernel_layout(k_in, "k"),
                   v = kernel_layout(v_in, "v");
  check_like(qp, q, "q_proxy");
  check_like(kp, q, "k_proxy");
  check_like(k, q, "k");
  check_like(v, q, "v");
  const int64_t H = q.size(1), D = q.size(3);
  check_like(out_in, q, "out");
  check_like(dout_in, q, "dout");
  const at::Tensor out = kernel_layout(heads_view(out_in, H, D, "out"), "out");
  const at::Tensor dout = kernel_layout(heads_view(dout_in, H, D, "dout"), "dout");
  const at::Tensor lse = checked_stats(lse_in, q, H, "lse");
  const at::Tensor lse_proxy = checked_stats(lse_proxy_in, q, qp.size(1), "lse_proxy");
  at::Tensor kl_grad;
  if (kl_grad_in) {
    check_value(kl_grad_in->numel() == 1,
                "flash_msa: kl_grad: expected one element, got " + shape_str(kl_grad_in->sizes()));
    check_same_device(q, *kl_grad_in, "kl_grad");
    kl_grad = kl_grad_in->to(stats_type(q)).contiguous();
  }
  if (kl_out) {
    check_value(kl_out->dim() == 0 && kl_out->scalar_type() == stats_type(q),
                std::string("flash_msa: kl_out: expected a 0-dim ") +
                    c10::toString(stats_type(q)) + " tensor, got " +
                    c10::toString(kl_out->scalar_type()) + " of shape " +
                    shape_str(kl_out->sizes()));
    check_same_device(q, *kl_out, "kl_out");
  }
  const bool warmup = !indices_in.has_value();
  const at::Tensor indices = warmup ? at::Tensor() : checked_indices(*indices_in, qp);
  Problem problem = make_problem(qp, kp, q, k, warmup ? 0 : indices.size(3), scale, proxy_scale,
                                 query_offset);
  const at::Tensor cu = set_documents(problem, cu_seqlens, q);

  at::Tensor dqp = at::empty(qp.sizes(), q.options()), dkp = at::empty(kp.sizes(), q.options());
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), q.options()),
             dv = at::empty(v.sizes(), q.options());
  const BackwardParams params{
      .problem = problem,
      .indices = warmup ? nullptr : indices.const_data_ptr<int32_t>(),
      .qp = const_view(qp),
      .kp = const_view(kp),
      .q = const_view(q),
      .k = const_view(k),
      .v = const_view(v),
      .out = const_view(out),
      .dout = const_view(dout),
      .lse = const_stats_ptr(lse),
      .lse_proxy = const_stats_ptr(lse_proxy),
      .kl_grad = kl_grad.defined() ? const_stats_ptr(kl_grad) : nullptr,
      .kl = kl_out ? stats_ptr(*kl_out) : nullptr,
      .dqp = mut_view(dqp),
      .dkp = mut_view(dkp),
      .dq = mut_view(dq),
      .dk = mut_view(dk),
      .dv = mut_view(dv)};
  if (on_cuda(q)) {
#ifdef FLASH_MSA_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    at::Tensor holder;
    const cuda::Workspace ws = workspace(cuda::backward_workspace_bytes(params, warmup), q, holder);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    warmup ? cuda::warmup_backward(params, ws, stream) : cuda::sparse_backward(params, ws, stream);
#endif
  } else {
    warmup ? cpu::warmup_backward(params) : cpu::sparse_backward(params);
  }
  return {dqp, dkp, dq, dk, dv};
}

bool built_with_cuda() {
#ifdef FLASH_MSA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace flash_msa::torch_ext
