// Host-side limits of the CUDA backend shared by the select, forward, backward and warmup
// entries: what the kernels need beyond the backend-independent validate(). Select keeps its own
// top-K bound in its entry file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "cuda/common/instantiate.h"
#include "cuda/schedule/schedule.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda {

inline constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

[[noreturn]] inline void limit_error(const char* argument, const std::string& expected,
                                     const std::string& got) {
  throw Error(std::string("flash_msa: ") + argument + ": expected " + expected +
              " (a limit of the CUDA backend), got " + got);
}

// Rows are read and written with 16-byte vector copies (and 4-byte fragment accesses in the
// attention kernels).
template <class T>
void check_vector_view(const char* name, const View4<T>& view) {
  const auto address = reinterpret_cast<uintptr_t>(view.data);
  if (address % 16 != 0)
    limit_error(name, "a 16-byte aligned data pointer",
                "address " + std::to_string(address) + " (" + std::to_string(address % 16) +
                    " bytes past 16)");
  const char* const what[3] = {"stride_b", "stride_h", "stride_s"};
  const int64_t stride[3] = {view.stride_b, view.stride_h, view.stride_s};
  for (int x = 0; x < 3; ++x) {
    if (stride[x] % 8 != 0)
      limit_error(name, std::string(what[x]) + " a multiple of 8 elements (16 bytes)",
                  std::to_string(stride[x]));
  }
}

// The views of the main-attention entries, sparse and warmup.
inline void check_views(const ForwardParams& p) {
  const std::pair<const char*, ConstView> views[] = {
      {"qp", p.qp}, {"kp", p.kp}, {"q", p.q}, {"k", p.k}, {"v", p.v}};
  for (const auto& [name, view] : views) check_vector_view(name, view);
  check_vector_view("out", p.out);
}

inline void check_views(const BackwardParams& p) {
  const std::pair<const char*, ConstView> inputs[] = {{"qp", p.qp},    {"kp", p.kp}, {"q", p.q},
                                                      {"k", p.k},      {"v", p.v},   {"out", p.out},
                                                      {"dout", p.dout}};
  for (const auto& [name, view] : inputs) check_vector_view(name, view);
  const std::pair<const char*, MutView> grads[] = {
      {"dqp", p.dqp}, {"dkp", p.dkp}, {"dq", p.dq}, {"dk", p.dk}, {"dv", p.dv}};
  for (const auto& [name, view] : grads) check_vector_view(name, view);
}

inline void check_dtype(const Problem& pr) {
  if (pr.dtype != DType::kBFloat16 && pr.dtype != DType::kFloat16)
    limit_error("dtype", "bf16 or fp16", dtype_name(pr.dtype));
}

// Token offsets (b * S + i, plus one block of slack) are int32 in the kernels.
inline void check_token_count(const Problem& pr) {
  if (pr.batch * pr.seqlen > kInt32Max - kBlockSize)
    limit_error("seqlen", "batch * seqlen below 2^31 - 128",
                std::to_string(pr.batch) + " * " + std::to_string(pr.seqlen));
}

// The (D, Dp) pairs the forward and backward kernels are instantiated for (common/instantiate.h).
inline bool supported_attention_dims(int64_t d, int64_t dp) {
#define FLASH_MSA_MATCH(T, D, DP) || (d == D && dp == DP)
  return false FLASH_MSA_ATTENTION_DIMS(FLASH_MSA_MATCH, );
#undef FLASH_MSA_MATCH
}

// Limits shared by the main-attention forward and backward, whose kernels hold the G main heads
// of one proxy head in one MMA tile of max_group rows and launch a (blocks, Hp, B) grid.
inline void check_attention_limits(const Problem& pr, int64_t max_group) {
  check_dtype(pr);
  if (!supported_attention_dims(pr.head_dim, pr.proxy_head_dim))
    limit_error("head_dim",
                "(head_dim, proxy_head_dim) in {(32, 32), (64, 32), (64, 64), (128, 64), "
                "(128, 128)}",
                "(" + std::to_string(pr.head_dim) + ", " + std::to_string(pr.proxy_head_dim) + ")");
  const int64_t group = pr.heads / pr.proxy_heads;
  if (group > max_group)
    limit_error("heads", "heads / proxy_heads <= " + std::to_string(max_group),
                std::to_string(group));
  if (pr.proxy_heads % pr.kv_heads != 0)
    limit_error("proxy_heads", "a multiple of kv_heads (each proxy group inside one kv group)",
                std::to_string(pr.proxy_heads) + " with kv_heads " + std::to_string(pr.kv_heads));
  check_token_count(pr);
  if (pr.batch > 65535 || pr.proxy_heads > 65535)
    limit_error("batch", "batch and proxy_heads at most 65535 (grid dimensions)",
                std::to_string(pr.batch) + ", " + std::to_string(pr.proxy_heads));
  if (pr.top_k > kInt32Max / 2) limit_error("top_k", "below 2^30", std::to_string(pr.top_k));
}

// Limits of the sparse (key-block-outer) kernels on top of the shared attention limits: tiles of
// 64 query rows, slots in 6 bits and tokens in 25 bits of a schedule entry, int32 edge counts.
inline void check_sparse_limits(const Problem& pr) {
  check_attention_limits(pr, 64);
  if (pr.top_k > (1 << schedule::kSlotBits))
    limit_error("top_k", "at most 64 blocks", std::to_string(pr.top_k));
  if (pr.seqlen >= schedule::kMaxTokens)
    limit_error("seqlen", "below 2^25 tokens per batch row", std::to_string(pr.seqlen));
  const int64_t edges = pr.batch * pr.proxy_heads * pr.queries() * pr.top_k;
  if (edges > kInt32Max)
    limit_error("top_k", "batch * proxy_heads * queries * top_k below 2^31", std::to_string(edges));
}

inline void check_workspace_pointer(const void* data) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  if (data == nullptr || address % 256 != 0)
    throw Error("flash_msa: workspace: expected a non-null 256-byte aligned pointer, got " +
                std::to_string(address));
}

// sizing_function names the public call that returns the size the caller should have asked for.
inline void check_workspace_bytes(size_t got, size_t needed, const char* sizing_function) {
  if (got < needed)
    throw Error("flash_msa: workspace: expected at least " + std::to_string(needed) + " bytes (" +
                sizing_function + "), got " + std::to_string(got));
}

}  // namespace flash_msa::cuda
