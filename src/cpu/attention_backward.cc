// Backward of both modes (SPEC sections 4, 5) over the cached selection, one (b, proxy head,
// query) row at a time: P is recomputed from the forward's lse, dq and dqp are written per row,
// and dk, dv, dkp go to per-thread accumulators (in the compute type: fp32, or double for float64
// tensors) that are summed in thread order. Rows are split statically, so results are bitwise
// reproducible for a given thread count.
#include <cmath>
#include <numeric>
#include <vector>

#include "common/documents.h"
#include "cpu/attention.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"
#include "cpu/tensor.h"
#include "flash_msa/cpu.h"

namespace flash_msa::cpu {
namespace {

// dst[b, h, s] = sum over threads of acc[t][b, h, s] for a [B, heads, S, C] accumulator.
template <class T>
void reduce_store(DType dtype, const std::vector<std::vector<T>>& acc, const MutView& dst,
                  int64_t batch, int64_t heads, int64_t seqlen, int64_t channels) {
  parallel_static(batch * heads * seqlen, kRowChunk, [&](int, StaticRows& rows) {
    std::vector<T> sum(static_cast<size_t>(channels));
    for (int64_t r; rows.next(r);) {
      std::fill(sum.begin(), sum.end(), T(0));
      for (const std::vector<T>& t : acc) {
        const T* row = &t[static_cast<size_t>(r * channels)];
        for (int64_t c = 0; c < channels; ++c) sum[static_cast<size_t>(c)] += row[c];
      }
      const int64_t b = r / (heads * seqlen), h = r / seqlen % heads, s = r % seqlen;
      store_row(dtype, dst.data, offset(dst, b, h, s), sum.data(), channels);
    }
  });
}

}  // namespace

template <class T>
void backward(const BackwardParams& params, bool warmup) {
  const Problem& pr = params.problem;
  const Dims d(pr);
  const std::vector<int32_t> starts = document_starts(pr, pr.cu_seqlens);
  const T* const lse_in = stats_ptr<T>(params.lse);
  const T* const lse_proxy_in = stats_ptr<T>(params.lse_proxy);
  const T* const kl_grad = stats_ptr<T>(params.kl_grad);
  const Packed<T> kp(pr.dtype, params.kp, d.B, d.Hpk, d.S, d.Dp);
  const Packed<T> k(pr.dtype, params.k, d.B, d.Hk, d.S, d.D);
  const Packed<T> v(pr.dtype, params.v, d.B, d.Hk, d.S, d.D);
  const int64_t max_keys = max_attended(d, warmup);
  // g = kl_weight * (pp - t): the KL gradient w / (B * Hp * S) folded into one factor.
  const T kl_weight = (kl_grad ? *kl_grad : T(0)) / static_cast<T>(d.kl_rows());
  T* const kl_out = stats_ptr<T>(params.kl);
  std::vector<double> kl_rows(kl_out ? static_cast<size_t>(d.rows()) : 0);
  const int threads = num_threads();
  const size_t kv_size = static_cast<size_t>(d.B * d.Hk * d.S * d.D);
  std::vector<std::vector<T>> dk_acc(threads), dv_acc(threads), dkp_acc(threads);

  run_workers(threads, [&](int tid) {
    StaticRows rows(d.rows(), kRowChunk, threads, tid);
    dk_acc[tid].assign(kv_size, T(0));
    dv_acc[tid].assign(kv_size, T(0));
    dkp_acc[tid].assign(static_cast<size_t>(d.B * d.Hpk * d.S * d.Dp), T(0));
    const size_t head_rows = static_cast<size_t>(d.G * d.D);
    std::vector<T> q(head_rows), dout(head_rows), out(head_rows), dq(head_rows);
    std::vector<T> delta(static_cast<size_t>(d.G)), qp(static_cast<size_t>(d.Dp)), dqp(qp.size());
    std::vector<T> prob(static_cast<size_t>(d.G * max_keys)), dprob(prob.size());
    std::vector<T> teacher(static_cast<size_t>(max_keys)), grad(teacher.size());
    std::vector<KeyRange> ranges(static_cast<size_t>(warmup ? 1 : d.K));
    for (int64_t r; rows.next(r);) {
      const auto [b, p, i, h0, pos, nr, n] =
          query_row(params, d, r, warmup, starts, ranges.data(), q.data());
      for (int64_t g = 0; g < d.G; ++g) {
        const size_t at = static_cast<size_t>(g * d.D);
        load_row(pr.dtype, params.dout.data, offset(params.dout, b, h0 + g, i), d.D, &dout[at]);
        load_row(pr.dtype, params.out.data, offset(params.out, b, h0 + g, i), d.D, &out[at]);
        delta[static_cast<size_t>(g)] = dot(&out[at], &dout[at], d.D);
      }
      // P from the forward statistics, then dA = P * (dO . v - Delta) in place of dP.
      group_dots(d, b, h0, q.data(), k, ranges.data(), nr, prob.data(), n);
      group_dots(d, b, h0, dout.data(), v, ranges.data(), nr, dprob.data(), n);
      for (int64_t g = 0; g < d.G; ++g) {
        const T lse = lse_in[(b * d.H + h0 + g) * d.Sq + i], dl = delta[static_cast<size_t>(g)];
        T* pg = &prob[static_cast<size_t>(g * n)];
        T* dg = &dprob[static_cast<size_t>(g * n)];
        for (int64_t x = 0; x < n; ++x) {
          pg[x] = std::exp(pg[x] - lse);
          dg[x] = pg[x] * (dg[x] - dl);
        }
      }
      std::fill(dq.begin(), dq.end(), T(0));
      group_axpy(d, b, h0, dprob.data(), k, ranges.data(), nr, n, dq.data());
      for (int64_t g = 0; g < d.G; ++g)
        store_row(pr.dtype, params.dq.data, offset(params.dq, b, h0 + g, i),
                  &dq[static_cast<size_t>(g * d.D)], d.D, pr.scale);
      // q is pre-scaled, so dk = scale * sum dA q needs no extra factor.
      group_scatter(d, b, h0, dprob.data(), q.data(), ranges.data(), nr, n, dk_acc[tid].data());
      group_scatter(d, b, h0, prob.data(), dout.data(), ranges.data(), nr, n, dv_acc[tid].data());

      std::fill(dqp.begin(), dqp.end(), T(0));
      if (kl_weight != T(0) || kl_out) {
        const int64_t pk = d.proxy_key_head(p);
        std::fill(teacher.begin(), teacher.begin() + n, T(0));
        for (int64_t g = 0; g < d.G; ++g)
          for (int64_t x = 0; x < n; ++x)
            teacher[static_cast<size_t>(x)] += prob[static_cast<size_t>(g * n + x)];
        load_row(pr.dtype, params.qp.data, offset(params.qp, b, p, i), d.Dp, qp.data());
        for (int64_t c = 0; c < d.Dp; ++c) qp[static_cast<size_t>(c)] *= pr.proxy_scale;
        proxy_dots(d, b, pk, qp.data(), kp, ranges.data(), nr, grad.data());
        const T lse_proxy = lse_proxy_in[r], inv_g = T(1) / static_cast<T>(d.G);
        double kl = 0;  // the KL value's row term, as the forward sums it
        for (int64_t x = 0; x < n; ++x) {
          const size_t at = static_cast<size_t>(x);
          const T t = teacher[at] * inv_g, log_pp = grad[at] - lse_proxy;
          if (kl_out && !(t <= 0)) kl += static_cast<double>(t) * (std::log(double(t)) - log_pp);
          grad[at] = kl_weight * (std::exp(log_pp) - t);
        }
        if (kl_out) kl_rows[static_cast<size_t>(r)] = kl;
        for_each_key_tile(ranges.data(), nr, [&](int64_t j, int64_t len, int64_t x) {
          axpy(dqp.data(), &grad[static_cast<size_t>(x)], 1, kp.row(b, pk, j), len, d.Dp);
        });
        T* dkp_base = &dkp_acc[tid][static_cast<size_t>((b * d.Hpk + pk) * d.S * d.Dp)];
        int64_t x = 0;
        for (int64_t rr = 0; rr < nr; ++rr)
          for (int64_t j = ranges[rr].begin; j < ranges[rr].end; ++j, ++x)
            axpy(dkp_base + j * d.Dp, &grad[static_cast<size_t>(x)], 1, qp.data(), 1, d.Dp);
      }
      store_row(pr.dtype, params.dqp.data, offset(params.dqp, b, p, i), dqp.data(), d.Dp,
                pr.proxy_scale);
    }
  });
  if (kl_out) *kl_out = kl_mean<T>(kl_rows, d);
  reduce_store(pr.dtype, dk_acc, params.dk, d.B, d.Hk, d.S, d.D);
  reduce_store(pr.dtype, dv_acc, params.dv, d.B, d.Hk, d.S, d.D);
  reduce_store(pr.dtype, dkp_acc, params.dkp, d.B, d.Hpk, d.S, d.Dp);
}

template void backward<float>(const BackwardParams&, bool);
template void backward<double>(const BackwardParams&, bool);

}  // namespace flash_msa::cpu
