// Public C++ API of flash-msa: MiniMax Sparse Attention (MSA) training operations.
//
// Framework-agnostic: raw pointers, int64 strides in elements, a dtype enum. The math is
// ../../docs/spec.md (a copy of the project contract): proxy select -> sparse main attention
// + KL alignment loss -> backward over the cached selection; warmup runs both branches densely.
//
// Every tensor argument is a 4-D view [batch, head, token, channel] whose channel stride is 1;
// query-side tensors have Problem::queries() tokens (S unless a query shard is given), key-side
// tensors seqlen (S);
// the other three strides are free (so [B,S,H,D] token-major buffers work without copies).
// Outputs are overwritten, never accumulated into. Invalid arguments throw flash_msa::Error with
// a message that names the argument and says what was expected and what was got.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace flash_msa {

inline constexpr int64_t kBlockSize = 128;  // BS: tokens per key block (fixed by the method)

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);
// The dtype of the statistics (lse, lse_proxy, kl, kl_grad) of a problem of `dtype`: float64
// for float64 (the CPU backend's double-precision mode), float32 otherwise.
inline DType stats_dtype(DType dtype) {
  return dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A strided 4-D view [b, h, s, c] with unit channel stride.
template <class T>
struct View4 {
  T* data = nullptr;
  int64_t stride_b = 0;
  int64_t stride_h = 0;
  int64_t stride_s = 0;
};
using ConstView = View4<const void>;
using MutView = View4<void>;

// Contiguous [d0, d1, d2, d3] strides for a View4.
template <class T>
View4<T> contiguous_view(T* data, int64_t heads, int64_t tokens, int64_t channels) {
  return {data, heads * tokens * channels, tokens * channels, channels};
}

// Shapes, scalars and document layout shared by every operation.
struct Problem {
  int64_t batch = 0;               // B
  int64_t seqlen = 0;              // S, tokens per batch row (any S >= 1)
  int64_t heads = 0;               // H main query heads
  int64_t kv_heads = 0;            // Hk main key/value heads, H % Hk == 0
  int64_t proxy_heads = 0;         // Hp proxy query heads, H % Hp == 0
  int64_t proxy_kv_heads = 0;      // Hpk proxy key heads, Hp % Hpk == 0
  int64_t head_dim = 0;            // D
  int64_t proxy_head_dim = 0;      // Dp
  int64_t top_k = 0;               // K selected blocks per (query, proxy head); ignored in warmup
  float scale = 0.f;               // main softmax scale, usually D ** -0.5
  float proxy_scale = 0.f;         // proxy score scale, usually Dp ** -0.5
  DType dtype = DType::kBFloat16;  // dtype of every q/k/v/proxy/out/gradient tensor
  // [num_docs + 1] int32 offsets over the flattened B*S token axis: 0 first, B*S last,
  // non-decreasing, holding every multiple of S. Null: each batch row is one document.
  // Lives on the device the operation runs on.
  const int32_t* cu_seqlens = nullptr;
  int64_t num_docs = 0;
  // A shard of the queries (context parallelism, docs/distributed.md): the query-side tensors
  // (qp, q, out, dout, dqp, dq, lse, lse_proxy, indices) hold query_len tokens per batch row,
  // query i at position query_offset + i of the seqlen-token sequence that the key-side tensors
  // (kp, k, v, dkp, dk, dv) and cu_seqlens describe. Nothing is copied: the views point at the
  // shard. query_len 0 (the default): every position is a query, query_offset must be 0.
  // The KL value and its gradient keep the mean over all B * Hp * seqlen rows, so the values of
  // the shards of a sequence add up to its KL loss.
  int64_t query_offset = 0;
  int64_t query_len = 0;

  int64_t queries() const { return query_len > 0 ? query_len : seqlen; }  // Sq
};

// How select scores the blocks it ranks.
enum class SelectPrecision : int32_t {
  // The scores of SPEC section 1: products of the input dtype summed in fp32 (float64 inputs on
  // the CPU: double). The default.
  kExact = 0,
  // An approximation for long contexts: q_proxy and k_proxy are quantised to FP8 E4M3 inside
  // the op, with one scale per token and head (amax / 448 of its Dp channels; x / scale rounded
  // to nearest even, saturated), the products summed in fp32 and scaled back, and the blocks
  // ranked on those fp32 scores as in kExact. The selection can differ from the exact one where
  // block scores lie close (docs/performance.md measures the overlap). CUDA: Hopper select
  // kernel at Dp = 128 only (select_kernels() says kHopper); the CPU backend quantises the same
  // way and scores in its compute type. Only the ranking changes: forward and backward take
  // the inputs unquantised.
  kFloat8E4M3 = 1,
};
const char* select_precision_name(SelectPrecision precision);  // "exact" or "float8_e4m3"

// Proxy scores -> max-pool per block -> top-K blocks (own block forced), SPEC section 1.
struct SelectParams {
  Problem problem;
  ConstView qp;      // [B, Hp, Sq, Dp]
  ConstView kp;      // [B, Hpk, S, Dp]
  int32_t* indices;  // [B, Hp, Sq, K] contiguous; ascending valid blocks, then -1
  SelectPrecision precision = SelectPrecision::kExact;
};

// Main attention over the selected blocks (sparse) or all visible keys (warmup), plus the
// proxy log-sum-exp over the same set and, when asked, the KL value. SPEC sections 2, 3, 5.
struct ForwardParams {
  Problem problem;
  const int32_t* indices = nullptr;  // [B, Hp, Sq, K] contiguous from select; null in warmup
  ConstView qp;                      // [B, Hp, Sq, Dp]
  ConstView kp;                      // [B, Hpk, S, Dp]
  ConstView q;                       // [B, H, Sq, D]
  ConstView k;                       // [B, Hk, S, D]
  ConstView v;                       // [B, Hk, S, D]
  MutView out;                       // [B, H, Sq, D]
  // Statistics, in the stats dtype (stats_dtype: float32, float64 for a float64 problem).
  void* lse = nullptr;        // [B, H, Sq] contiguous, natural log of scaled scores
  void* lse_proxy = nullptr;  // [B, Hp, Sq] contiguous, proxy log-sum-exp over T(p, i)
  void* kl = nullptr;         // [1], the KL loss value; null: not computed
};

// Backward over the cached selection: main gradients from dout, proxy gradients from the
// KL weight w (read where it lives, never synchronised to the host). SPEC sections 4, 5.
// Every backend is deterministic: gradients are bitwise reproducible run to run. With a query
// shard, dkp, dk and dv hold the shard's queries' part of the key gradients (the sum over the
// shards of a sequence is its gradient).
struct BackwardParams {
  Problem problem;
  const int32_t* indices = nullptr;  // [B, Hp, Sq, K] contiguous; null in warmup
  ConstView qp;                      // [B, Hp, Sq, Dp]
  ConstView kp;                      // [B, Hpk, S, Dp]
  ConstView q;                       // [B, H, Sq, D]
  ConstView k;                       // [B, Hk, S, D]
  ConstView v;                       // [B, Hk, S, D]
  ConstView out;                     // [B, H, Sq, D] forward output
  ConstView dout;                    // [B, H, Sq, D] upstream gradient of out
  // Statistics, in the stats dtype (stats_dtype: float32, float64 for a float64 problem).
  const void* lse = nullptr;        // [B, H, Sq] contiguous, from the forward
  const void* lse_proxy = nullptr;  // [B, Hp, Sq] contiguous, from the forward
  const void* kl_grad = nullptr;    // [1] upstream gradient w of kl; null: w = 0
  // [1] out: the KL loss value from the teacher the backward recomputes (the forward's value up
  // to rounding; the forward can then skip its teacher pass); null: not computed.
  void* kl = nullptr;
  MutView dqp;  // [B, Hp, Sq, Dp]
  MutView dkp;  // [B, Hpk, S, Dp]
  MutView dq;   // [B, H, Sq, D]
  MutView dk;   // [B, Hk, S, D]
  MutView dv;   // [B, Hk, S, D]
};

// Block indices made outside the library, checked by the rule validate_indices_values applies
// (cuda::check_indices on the device). Of the problem only batch, seqlen, proxy_heads, top_k
// (K), the query shard and the documents are read.
struct CheckIndicesParams {
  Problem problem;
  const int32_t* indices = nullptr;  // [B, Hp, Sq, K] contiguous
};

// Validation shared by every backend; each throws flash_msa::Error.
void validate(const CheckIndicesParams& params);
void validate(const SelectParams& params);
void validate(const ForwardParams& params, bool warmup);
void validate(const BackwardParams& params, bool warmup);

// Host-side checks of device-independent contents (cu_seqlens values, user-supplied indices).
// The CPU backend calls them; GPU callers may call them on host copies.
void validate_cu_seqlens_values(const Problem& problem, const int32_t* host_cu_seqlens);
void validate_indices_values(const Problem& problem, const int32_t* host_cu_seqlens,
                             const int32_t* host_indices);

}  // namespace flash_msa
