// A float64 reference of the MSA forward math (SPEC sections 1-3, 5), written directly from the
// formulas and kept naive so that it is easy to check by eye: block scores for selection, main
// attention over T(p, i), the proxy log-sum-exp and the KL value.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/problem.h"

namespace flash_msa::test {

inline double dot(const Tensor& a, int64_t b, int64_t h, int64_t s, const Tensor& c, int64_t hc,
                  int64_t j) {
  double acc = 0;
  for (int64_t x = 0; x < a.n3; ++x) acc += double(a.at(b, h, s, x)) * double(c.at(b, hc, j, x));
  return acc;
}

// m(p, i, n) as [B, Hp, S, NB]: +inf on the own block, -inf where no key is visible.
inline std::vector<double> ref_block_scores(const Config& cfg, const Inputs& in) {
  const Dims& d = cfg.d;
  const int64_t nb = d.NB();
  const std::vector<int32_t> doc = doc_ids(cfg);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> m(static_cast<size_t>(d.B * d.Hp * d.S * nb), -inf);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t p = 0; p < d.Hp; ++p)
      for (int64_t i = 0; i < d.S; ++i) {
        double* row = &m[static_cast<size_t>(((b * d.Hp + p) * d.S + i) * nb)];
        for (int64_t j = 0; j <= i; ++j) {
          if (doc[b * d.S + j] != doc[b * d.S + i]) continue;
          const double s = double(cfg.proxy()) * dot(in.qp, b, p, i, in.kp, p / (d.Hp / d.Hpk), j);
          row[j / kBlockSize] = std::max(row[j / kBlockSize], s);
        }
        row[i / kBlockSize] = inf;
      }
  return m;
}

struct RefForward {
  std::vector<float> out, lse, lse_proxy;
  double kl = 0;
};

// The keys attended by (b, p, i): visible, and in a selected block unless warmup.
inline std::vector<int64_t> attended(const Config& cfg, const std::vector<int32_t>& doc,
                                     bool warmup, const std::vector<int32_t>& indices, int64_t b,
                                     int64_t p, int64_t i) {
  const Dims& d = cfg.d;
  std::vector<char> sel(static_cast<size_t>(d.NB()), warmup ? 1 : 0);
  if (!warmup) {
    const int32_t* row = &indices[static_cast<size_t>(((b * d.Hp + p) * d.S + i) * d.K)];
    for (int64_t x = 0; x < d.K; ++x)
      if (row[x] >= 0) sel[static_cast<size_t>(row[x])] = 1;
  }
  std::vector<int64_t> t;
  for (int64_t j = 0; j <= i; ++j)
    if (doc[b * d.S + j] == doc[b * d.S + i] && sel[static_cast<size_t>(j / kBlockSize)])
      t.push_back(j);
  return t;
}

inline RefForward ref_forward(const Config& cfg, const Inputs& in, bool warmup,
                              const std::vector<int32_t>& indices) {
  const Dims& d = cfg.d;
  const std::vector<int32_t> doc = doc_ids(cfg);
  const int64_t g = d.H / d.Hp;
  RefForward r;
  r.out.assign(static_cast<size_t>(d.B * d.H * d.S * d.D), 0.f);
  r.lse.assign(static_cast<size_t>(d.B * d.H * d.S), 0.f);
  r.lse_proxy.assign(static_cast<size_t>(d.B * d.Hp * d.S), 0.f);
  double kl_sum = 0;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t p = 0; p < d.Hp; ++p)
      for (int64_t i = 0; i < d.S; ++i) {
        const std::vector<int64_t> t = attended(cfg, doc, warmup, indices, b, p, i);
        std::vector<double> teacher(t.size(), 0.0);
        for (int64_t h = p * g; h < (p + 1) * g; ++h) {
          const int64_t c = h / (d.H / d.Hk);
          std::vector<double> a(t.size());
          double mx = -std::numeric_limits<double>::infinity();
          for (size_t x = 0; x < t.size(); ++x) {
            a[x] = double(cfg.main_scale()) * dot(in.q, b, h, i, in.k, c, t[x]);
            mx = std::max(mx, a[x]);
          }
          double sum = 0;
          for (double ax : a) sum += std::exp(ax - mx);
          const double lse = mx + std::log(sum);
          r.lse[static_cast<size_t>((b * d.H + h) * d.S + i)] = float(lse);
          for (int64_t ch = 0; ch < d.D; ++ch) {
            double o = 0;
            for (size_t x = 0; x < t.size(); ++x)
              o += std::exp(a[x] - lse) * double(in.v.at(b, c, t[x], ch));
            r.out[static_cast<size_t>(((b * d.H + h) * d.S + i) * d.D + ch)] = float(o);
          }
          for (size_t x = 0; x < t.size(); ++x) teacher[x] += std::exp(a[x] - lse) / double(g);
        }
        const int64_t pk = p / (d.Hp / d.Hpk);
        std::vector<double> s(t.size());
        double mx = -std::numeric_limits<double>::infinity();
        for (size_t x = 0; x < t.size(); ++x) {
          s[x] = double(cfg.proxy()) * dot(in.qp, b, p, i, in.kp, pk, t[x]);
          mx = std::max(mx, s[x]);
        }
        double sum = 0;
        for (double sx : s) sum += std::exp(sx - mx);
        const double lse_p = mx + std::log(sum);
        r.lse_proxy[static_cast<size_t>((b * d.Hp + p) * d.S + i)] = float(lse_p);
        for (size_t x = 0; x < t.size(); ++x)
          if (teacher[x] > 0) kl_sum += teacher[x] * (std::log(teacher[x]) - (s[x] - lse_p));
      }
  r.kl = kl_sum / double(d.B * d.Hp * d.S);
  return r;
}

// ---- the FP8 select's quantisation (SelectPrecision::kFloat8E4M3, msa.h), by brute force ----

// The value of the non-negative finite E4M3 code c (0 .. 0x7e): exponent c / 8 with bias 7,
// subnormal below 8.
inline double e4m3_value(int code) {
  const int e = code >> 3, m = code & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}

// The E4M3 code nearest to x, the even code on a tie, +-448 beyond; NaN is never passed.
inline uint8_t nearest_e4m3(float x) {
  const double a = std::fabs(double(x));
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double d = std::fabs(e4m3_value(c) - a), d_best = std::fabs(e4m3_value(best) - a);
    if (d < d_best || (d == d_best && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

inline float e4m3_scale_of(const float* row, int64_t n) {
  float amax = 0.f;
  for (int64_t c = 0; c < n; ++c) amax = std::max(amax, std::fabs(row[c]));
  return amax > 0.f ? amax / 448.f : 1.f;
}

// t with every token row replaced by what its FP8 quantisation dequantises to: code of
// x / scale, times scale (scale = amax / 448 of the row).
inline Tensor fp8_dequantised(const Tensor& t) {
  Tensor out = t;
  for (size_t r = 0; r * t.n3 < t.v.size(); ++r) {
    float* row = &out.v[r * static_cast<size_t>(t.n3)];
    const float scale = e4m3_scale_of(row, t.n3);
    for (int64_t c = 0; c < t.n3; ++c) {
      const uint8_t code = nearest_e4m3(row[c] / scale);
      const double v = e4m3_value(code & 0x7f);
      row[c] = static_cast<float>((code & 0x80 ? -v : v) * scale);
    }
  }
  return out;
}

// The proxy inputs as the FP8 select scores them.
inline Inputs fp8_inputs(const Inputs& in) {
  Inputs out = in;
  out.qp = fp8_dequantised(in.qp);
  out.kp = fp8_dequantised(in.kp);
  return out;
}

// Checks a selection against float64 block scores (SPEC 1 and 6): per row, valid entries strictly
// ascending then -1s, every valid entry a visible block at or before the own block, the own block
// present, min(K, visible blocks) valid entries, and each selected block's score >= the score of
// every unselected visible block minus `tol`. Returns the number of bad rows; `first` describes
// one.
inline int64_t selection_errors(const Config& cfg, const Inputs& in,
                                const std::vector<int32_t>& indices, double tol,
                                std::string* first) {
  const Dims& d = cfg.d;
  const int64_t nb = d.NB();
  const std::vector<double> m = ref_block_scores(cfg, in);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  int64_t bad = 0;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t p = 0; p < d.Hp; ++p)
      for (int64_t i = 0; i < d.S; ++i) {
        const size_t r = static_cast<size_t>((b * d.Hp + p) * d.S + i);
        const int32_t* row = &indices[r * static_cast<size_t>(d.K)];
        const double* score = &m[r * static_cast<size_t>(nb)];
        std::string why;
        std::vector<char> sel(static_cast<size_t>(nb), 0);
        int64_t valid = 0, visible = 0;
        for (int64_t n = 0; n < nb; ++n) visible += score[n] > neg_inf;
        for (int64_t x = 0; x < d.K; ++x) {
          const int32_t e = row[x];
          if (e == -1) continue;
          if (x > 0 && row[x - 1] == -1) why = "-1 before a valid entry";
          if (x > 0 && row[x - 1] != -1 && row[x - 1] >= e) why = "not strictly ascending";
          if (e < 0 || e > i / kBlockSize) {
            why = "entry out of [0, i/128]: " + std::to_string(e);
            continue;
          }
          if (score[e] == neg_inf) why = "selected a block with no visible key";
          sel[static_cast<size_t>(e)] = 1;
          ++valid;
        }
        if (why.empty() && !sel[static_cast<size_t>(i / kBlockSize)]) why = "own block missing";
        if (why.empty() && valid != std::min<int64_t>(d.K, visible))
          why = "valid entries " + std::to_string(valid) + ", want " +
                std::to_string(std::min<int64_t>(d.K, visible));
        if (why.empty()) {
          double worst_selected = std::numeric_limits<double>::infinity();
          double best_unselected = neg_inf;
          for (int64_t n = 0; n < nb; ++n) {
            if (sel[static_cast<size_t>(n)])
              worst_selected = std::min(worst_selected, score[n]);
            else
              best_unselected = std::max(best_unselected, score[n]);
          }
          if (worst_selected < best_unselected - tol)
            why = "selected score " + std::to_string(worst_selected) + " < unselected " +
                  std::to_string(best_unselected);
        }
        if (!why.empty()) {
          if (bad == 0 && first)
            *first = "b " + std::to_string(b) + " p " + std::to_string(p) + " i " +
                     std::to_string(i) + ": " + why;
          ++bad;
        }
      }
  return bad;
}

}  // namespace flash_msa::test
