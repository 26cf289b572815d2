// Proxy selection (SPEC section 1): per (b, p, i), the max proxy score of every visible block
// before the own block, then the top K - 1 of them plus the own block, ascending, -1 padded.
// Memory is linear in S: one query row and its block scores per thread. The FP8 precision
// scores the proxies as their FP8 quantisation dequantises them.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "common/documents.h"
#include "common/fp8.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"
#include "cpu/tensor.h"
#include "flash_msa/cpu.h"

namespace flash_msa::cpu {
namespace {

// SelectPrecision::kFloat8E4M3: the n values of a token row replaced by what their FP8
// quantisation (one scale per row, common/fp8.h) dequantises to.
template <class T>
void fp8_round_trip(T* row, int64_t n) {
  float amax = 0.f;
  for (int64_t c = 0; c < n; ++c) amax = std::max(amax, std::fabs(static_cast<float>(row[c])));
  const float scale = e4m3_scale(amax);
  for (int64_t c = 0; c < n; ++c)
    row[c] = static_cast<T>(e4m3_to_float(float_to_e4m3(static_cast<float>(row[c]) / scale))) *
             static_cast<T>(scale);
}

// T: the compute type (float, or double for float64 tensors).
template <class T>
void select_blocks(const SelectParams& params) {
  const Problem& pr = params.problem;
  const std::vector<int32_t> starts = document_starts(pr, pr.cu_seqlens);
  const int64_t B = pr.batch, S = pr.seqlen, Hp = pr.proxy_heads, Dp = pr.proxy_head_dim;
  const int64_t K = pr.top_k, num_blocks = (S + kBlockSize - 1) / kBlockSize;
  const int64_t Sq = pr.queries();  // query i at position query_offset + i
  Packed<T> kp(pr.dtype, params.kp, B, pr.proxy_kv_heads, S, Dp);
  const bool fp8 = params.precision == SelectPrecision::kFloat8E4M3;
  if (fp8)
    parallel_static(B * pr.proxy_kv_heads * S, Packed<T>::kLoadChunk, [&](int, StaticRows& it) {
      for (int64_t r; it.next(r);) fp8_round_trip(&kp.data[static_cast<size_t>(r * Dp)], Dp);
    });
  const int64_t proxy_group = Hp / pr.proxy_kv_heads;

  // Query cost grows with i, so rows are handed out dynamically; results do not depend on it.
  parallel_dynamic(B * Hp * Sq, kRowChunk, [&](int, DynamicRows& rows) {
    std::vector<T> qp(static_cast<size_t>(Dp)), scores(kBlockSize);
    std::vector<std::pair<T, int32_t>> candidates(static_cast<size_t>(num_blocks));
    std::vector<int32_t> chosen(static_cast<size_t>(K));
    for (int64_t r; rows.next(r);) {
      const int64_t b = r / (Hp * Sq), p = r / Sq % Hp, i = r % Sq, pos = pr.query_offset + i;
      const int64_t start = starts[static_cast<size_t>(b * S + pos)], own = pos / kBlockSize;
      load_row(pr.dtype, params.qp.data, offset(params.qp, b, p, i), Dp, qp.data());
      if (fp8) fp8_round_trip(qp.data(), Dp);
      // Scores are ranked unscaled: proxy_scale > 0 preserves the order and skips a rounding.
      int64_t count = 0;
      for (int64_t n = start / kBlockSize; n < own; ++n) {
        const int64_t j0 = std::max(n * kBlockSize, start), len = (n + 1) * kBlockSize - j0;
        dots(qp.data(), kp.row(b, p / proxy_group, j0), len, Dp, scores.data());
        const T best = *std::max_element(scores.begin(), scores.begin() + len);
        if (!std::isnan(best))
          candidates[static_cast<size_t>(count++)] = {best, static_cast<int32_t>(n)};
      }
      // Higher score first; on equal scores the lower block index wins.
      const int64_t take = std::min(count, K - 1);
      std::partial_sort(candidates.begin(), candidates.begin() + take, candidates.begin() + count,
                        [](const auto& x, const auto& y) {
                          return x.first > y.first || (x.first == y.first && x.second < y.second);
                        });
      for (int64_t x = 0; x < take; ++x)
        chosen[static_cast<size_t>(x)] = candidates[static_cast<size_t>(x)].second;
      std::sort(chosen.begin(), chosen.begin() + take);
      int32_t* out = params.indices + r * K;
      std::copy(chosen.begin(), chosen.begin() + take, out);
      out[take] = static_cast<int32_t>(own);
      std::fill(out + take + 1, out + K, -1);
    }
  });
}

}  // namespace

void select(const SelectParams& params) {
  validate(params);
  validate_cu_seqlens_values(params.problem, params.problem.cu_seqlens);
  with_compute_type(params.problem.dtype,
                    [&](auto zero) { select_blocks<decltype(zero)>(params); });
}

}  // namespace flash_msa::cpu
