// Argument validation shared by every backend. Params checks look only at shapes, pointers and
// strides (they never dereference a tensor, which may live on a device); the *_values checks
// read host copies of cu_seqlens and indices.
#include <cmath>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/documents.h"
#include "common/index_rule.h"
#include "flash_msa/msa.h"

namespace flash_msa {
namespace {

void check_positive(const char* name, int64_t value) {
  if (value <= 0) fail(name, "> 0", str(value));
}

void check_multiple(const char* name, int64_t value, const char* of_name, int64_t of) {
  if (value % of != 0)
    fail(name, std::string("a multiple of ") + of_name + " (" + str(of) + ")", str(value));
}

void check_scale(const char* name, float value) {
  if (!(std::isfinite(value) && value > 0.f)) fail(name, "a finite value > 0", str(value));
}

void check_pointer(const char* name, const void* pointer) {
  if (pointer == nullptr) fail(name, "a non-null pointer", "null");
}

// A [b, h, s, c] view with unit channel stride: rows of one head must not overlap.
template <class T>
void check_view(const char* name, const View4<T>& view, int64_t channels,
                const char* channels_name) {
  check_pointer(name, view.data);
  if (view.stride_b < 0) fail(name, "stride_b >= 0", str(view.stride_b));
  if (view.stride_h < 0) fail(name, "stride_h >= 0", str(view.stride_h));
  if (view.stride_s < channels)
    fail(name, "stride_s >= " + str(channels) + " (" + channels_name + ")", str(view.stride_s));
}

enum class Stage { kSelect, kSparse, kWarmup };

void check_layout(const Problem& p);

void check_problem(const Problem& p, Stage stage) {
  check_positive("batch", p.batch);
  check_positive("seqlen", p.seqlen);
  check_positive("heads", p.heads);
  check_positive("kv_heads", p.kv_heads);
  check_positive("proxy_heads", p.proxy_heads);
  check_positive("proxy_kv_heads", p.proxy_kv_heads);
  check_positive("head_dim", p.head_dim);
  check_positive("proxy_head_dim", p.proxy_head_dim);
  check_multiple("heads", p.heads, "kv_heads", p.kv_heads);
  check_multiple("heads", p.heads, "proxy_heads", p.proxy_heads);
  check_multiple("proxy_heads", p.proxy_heads, "proxy_kv_heads", p.proxy_kv_heads);
  if (stage != Stage::kWarmup && p.top_k < 1) fail("top_k", ">= 1", str(p.top_k));
  if (stage != Stage::kSelect) check_scale("scale", p.scale);
  check_scale("proxy_scale", p.proxy_scale);
  static_cast<void>(dtype_size(p.dtype));  // throws on an unknown dtype
  check_layout(p);
}

// The documents and the query shard.
void check_layout(const Problem& p) {
  if (p.cu_seqlens != nullptr && p.num_docs < 1)
    fail("num_docs", ">= 1 when cu_seqlens is given", str(p.num_docs));
  if (p.query_len < 0) fail("query_len", ">= 0 (0: every position)", str(p.query_len));
  if (p.query_len == 0 && p.query_offset != 0)
    fail("query_offset", "0 when query_len is 0 (every position is a query)", str(p.query_offset));
  if (p.query_offset < 0 || p.query_offset + p.query_len > p.seqlen)
    fail("query_offset", "a shard inside the sequence: 0 <= query_offset and query_offset + "
         "query_len (" + str(p.query_len) + ") <= seqlen (" + str(p.seqlen) + ")",
         str(p.query_offset));
}

template <class P>
void check_inputs(const P& p) {
  check_view("qp", p.qp, p.problem.proxy_head_dim, "proxy_head_dim");
  check_view("kp", p.kp, p.problem.proxy_head_dim, "proxy_head_dim");
  check_view("q", p.q, p.problem.head_dim, "head_dim");
  check_view("k", p.k, p.problem.head_dim, "head_dim");
  check_view("v", p.v, p.problem.head_dim, "head_dim");
}

std::string row_name(int64_t b, int64_t p, int64_t i) {
  return "(b " + str(b) + ", p " + str(p) + ", i " + str(i) + ")";
}

}  // namespace

void validate(const CheckIndicesParams& params) {
  const Problem& p = params.problem;
  check_positive("batch", p.batch);
  check_positive("seqlen", p.seqlen);
  check_positive("proxy_heads", p.proxy_heads);
  if (p.top_k < 1) fail("top_k", ">= 1", str(p.top_k));
  check_layout(p);
  check_pointer("indices", params.indices);
}

void validate(const SelectParams& params) {
  check_problem(params.problem, Stage::kSelect);
  check_view("qp", params.qp, params.problem.proxy_head_dim, "proxy_head_dim");
  check_view("kp", params.kp, params.problem.proxy_head_dim, "proxy_head_dim");
  check_pointer("indices", params.indices);
  if (params.precision != SelectPrecision::kExact &&
      params.precision != SelectPrecision::kFloat8E4M3)
    fail("precision", "kExact or kFloat8E4M3", str(static_cast<int32_t>(params.precision)));
}

void validate(const ForwardParams& params, bool warmup) {
  check_problem(params.problem, warmup ? Stage::kWarmup : Stage::kSparse);
  if (!warmup) check_pointer("indices", params.indices);
  check_inputs(params);
  check_view("out", params.out, params.problem.head_dim, "head_dim");
  check_pointer("lse", params.lse);
  check_pointer("lse_proxy", params.lse_proxy);
}

void validate(const BackwardParams& params, bool warmup) {
  const Problem& p = params.problem;
  check_problem(p, warmup ? Stage::kWarmup : Stage::kSparse);
  if (!warmup) check_pointer("indices", params.indices);
  check_inputs(params);
  check_view("out", params.out, p.head_dim, "head_dim");
  check_view("dout", params.dout, p.head_dim, "head_dim");
  check_pointer("lse", params.lse);
  check_pointer("lse_proxy", params.lse_proxy);
  check_view("dqp", params.dqp, p.proxy_head_dim, "proxy_head_dim");
  check_view("dkp", params.dkp, p.proxy_head_dim, "proxy_head_dim");
  check_view("dq", params.dq, p.head_dim, "head_dim");
  check_view("dk", params.dk, p.head_dim, "head_dim");
  check_view("dv", params.dv, p.head_dim, "head_dim");
}

void validate_cu_seqlens_values(const Problem& problem, const int32_t* host_cu_seqlens) {
  if (host_cu_seqlens == nullptr) return;
  const int32_t* cu = host_cu_seqlens;
  const int64_t n = problem.num_docs, total = problem.batch * problem.seqlen;
  if (cu[0] != 0) fail("cu_seqlens", "cu_seqlens[0] == 0", str(cu[0]));
  if (cu[n] != total)
    fail("cu_seqlens", "cu_seqlens[num_docs] == batch * seqlen (" + str(total) + ")", str(cu[n]));
  int64_t next_row_start = problem.seqlen;
  for (int64_t d = 1; d <= n; ++d) {
    if (cu[d] < cu[d - 1])
      fail("cu_seqlens", "non-decreasing offsets",
           "cu_seqlens[" + str(d) + "] = " + str(cu[d]) + " < cu_seqlens[" + str(d - 1) +
               "] = " + str(cu[d - 1]));
    if (cu[d] > next_row_start)
      fail("cu_seqlens", "every multiple of seqlen as an offset (" + str(next_row_start) + ")",
           "cu_seqlens[" + str(d) + "] = " + str(cu[d]) + " after " + str(cu[d - 1]));
    if (cu[d] == next_row_start) next_row_start += problem.seqlen;
  }
}

void validate_index_row(const Problem& problem, const std::vector<int32_t>& starts,
                        int64_t row_id, const int32_t* row) {
  const int64_t Sq = problem.queries(), i = row_id % Sq, bp = row_id / Sq;
  const int64_t b = bp / problem.proxy_heads, p = bp % problem.proxy_heads;
  const int64_t pos = problem.query_offset + i;  // the query's position
  const int64_t own = pos / kBlockSize;
  const int64_t first_visible = starts[static_cast<size_t>(b * problem.seqlen + pos)] / kBlockSize;
  const IndexCheck check = check_index_row(row, problem.top_k, own, first_visible);
  if (check.fault == IndexFault::kNone) return;
  const std::string at = " at " + row_name(b, p, i);
  const int64_t x = check.slot;
  switch (check.fault) {
    case IndexFault::kOutOfRange:
      fail("indices", "a block in [0, " + str(own) + "] or -1" + at, str(row[x]));
    case IndexFault::kOtherDocument:
      fail("indices",
           "a block holding a key of the query's document (blocks " + str(first_visible) + ".." +
               str(own) + ")" + at,
           str(row[x]));
    case IndexFault::kNotAscending:
      fail("indices", "strictly ascending blocks" + at, str(row[x]) + " after " + str(row[x - 1]));
    case IndexFault::kAfterPadding:
      fail("indices", "-1 only after every valid block" + at, str(row[x]) + " after -1");
    default:
      fail("indices", "the own block " + str(own) + at, "none");
  }
}

void validate_indices_values(const Problem& problem, const int32_t* host_cu_seqlens,
                             const int32_t* host_indices) {
  check_pointer("indices", host_indices);
  validate_cu_seqlens_values(problem, host_cu_seqlens);
  const std::vector<int32_t> starts = document_starts(problem, host_cu_seqlens);
  const int64_t rows = problem.batch * problem.proxy_heads * problem.queries();
  for (int64_t r = 0; r < rows; ++r)
    validate_index_row(problem, starts, r, host_indices + r * problem.top_k);
}

}  // namespace flash_msa
