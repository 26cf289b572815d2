// Forward of both modes (SPEC sections 2, 3, 5), one (b, proxy head, query) row at a time:
// main attention for the G heads of the group over the attended keys T(p, i), the teacher t,
// the proxy log-sum-exp over the same keys and the row's KL term. Scratch is O(G * |T|) per
// thread, so sparse mode is linear in S and warmup never holds an S x S buffer.
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/documents.h"
#include "cpu/attention.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"
#include "cpu/tensor.h"
#include "flash_msa/cpu.h"

namespace flash_msa::cpu {

template <class T>
void forward(const ForwardParams& params, bool warmup) {
  const Problem& pr = params.problem;
  const Dims d(pr);
  const std::vector<int32_t> starts = document_starts(pr, pr.cu_seqlens);
  T* const lse_out = stats_ptr<T>(params.lse);
  T* const lse_proxy_out = stats_ptr<T>(params.lse_proxy);
  T* const kl_out = stats_ptr<T>(params.kl);
  const Packed<T> kp(pr.dtype, params.kp, d.B, d.Hpk, d.S, d.Dp);
  const Packed<T> k(pr.dtype, params.k, d.B, d.Hk, d.S, d.D);
  const Packed<T> v(pr.dtype, params.v, d.B, d.Hk, d.S, d.D);
  const int64_t max_keys = max_attended(d, warmup);
  // Per-row KL terms, summed in row order afterwards so the value does not depend on threads.
  std::vector<double> kl_rows(kl_out ? static_cast<size_t>(d.rows()) : 0);

  parallel_dynamic(d.rows(), kRowChunk, [&](int, DynamicRows& rows) {
    const size_t head_rows = static_cast<size_t>(d.G * d.D);
    std::vector<T> q(head_rows), o(head_rows), qp(static_cast<size_t>(d.Dp));
    std::vector<T> a(static_cast<size_t>(d.G * max_keys));
    std::vector<T> teacher(static_cast<size_t>(max_keys)), s(teacher.size());
    std::vector<KeyRange> ranges(static_cast<size_t>(warmup ? 1 : d.K));
    for (int64_t r; rows.next(r);) {
      const auto [b, p, i, h0, pos, nr, n] =
          query_row(params, d, r, warmup, starts, ranges.data(), q.data());
      group_dots(d, b, h0, q.data(), k, ranges.data(), nr, a.data(), n);
      std::fill(teacher.begin(), teacher.begin() + n, T(0));
      for (int64_t g = 0; g < d.G; ++g) {
        T* pg = &a[static_cast<size_t>(g * n)];
        lse_out[(b * d.H + h0 + g) * d.Sq + i] = softmax(pg, n);
        for (int64_t x = 0; x < n; ++x) teacher[static_cast<size_t>(x)] += pg[x];
      }
      std::fill(o.begin(), o.end(), T(0));
      group_axpy(d, b, h0, a.data(), v, ranges.data(), nr, n, o.data());
      for (int64_t g = 0; g < d.G; ++g)
        store_row(pr.dtype, params.out.data, offset(params.out, b, h0 + g, i),
                  &o[static_cast<size_t>(g * d.D)], d.D);

      load_row(pr.dtype, params.qp.data, offset(params.qp, b, p, i), d.Dp, qp.data());
      for (int64_t c = 0; c < d.Dp; ++c) qp[static_cast<size_t>(c)] *= pr.proxy_scale;
      proxy_dots(d, b, d.proxy_key_head(p), qp.data(), kp, ranges.data(), nr, s.data());
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t x = 0; x < n; ++x) mx = std::max(mx, s[static_cast<size_t>(x)]);
      double sum = 0;
      for (int64_t x = 0; x < n; ++x) sum += std::exp(s[static_cast<size_t>(x)] - mx);
      const double lse_proxy = mx + std::log(sum);
      lse_proxy_out[r] = static_cast<T>(lse_proxy);
      if (kl_out) {
        double kl = 0;
        for (int64_t x = 0; x < n; ++x) {
          const double t = teacher[static_cast<size_t>(x)] / static_cast<double>(d.G);
          if (!(t <= 0)) kl += t * (std::log(t) - (s[static_cast<size_t>(x)] - lse_proxy));
        }
        kl_rows[static_cast<size_t>(r)] = kl;
      }
    }
  });
  if (kl_out) *kl_out = kl_mean<T>(kl_rows, d);
}

template void forward<float>(const ForwardParams&, bool);
template void forward<double>(const ForwardParams&, bool);

}  // namespace flash_msa::cpu
