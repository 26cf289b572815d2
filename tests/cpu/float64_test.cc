// float64 on the CPU backend (include/flash_msa/cpu.h): every operation computes in double
// precision throughout, and the statistics (lse, lse_proxy, kl, kl_grad) are double storage.
//
// Checked against a naive double forward and backward written here from SPEC sections 2-5 (every
// output and gradient to 1e-12 of its largest value; the double path lands near 1e-15, while
// fp32 arithmetic anywhere, the statistics included, leaves 1e-7 or more), against double
// central differences (directional derivatives to 3e-8 of |grad| |dir|, observed below 5e-9),
// and against the fp32 run of the same inputs (agreement to fp32 rounding, same selection).
// Self-contained: double buffers and the reference live in this file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "flash_msa/cpu.h"
#include "flash_msa/msa.h"

namespace flash_msa::test {
namespace {

struct Shape {
  int64_t B, S, H, Hk, Hp, Hpk, D, Dp, K;
  std::vector<int32_t> cu;  // offsets over B*S; empty: one document per row
};

// Contiguous [B, heads, S, C] double tensors of one problem, values representable in fp32 so
// that the fp32 run sees the same inputs.
struct Data {
  Shape s;
  std::vector<double> qp, kp, q, k, v, dout;
  double scale, proxy_scale, kl_grad = 0.7;

  Data(Shape shape, uint32_t seed) : s(std::move(shape)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    auto fill = [&](std::vector<double>& t, int64_t heads, int64_t channels) {
      t.resize(static_cast<size_t>(s.B * heads * s.S * channels));
      for (double& x : t) x = normal(rng);
    };
    fill(qp, s.Hp, s.Dp);
    fill(kp, s.Hpk, s.Dp);
    fill(q, s.H, s.D);
    fill(k, s.Hk, s.D);
    fill(v, s.Hk, s.D);
    fill(dout, s.H, s.D);
    // The C++ API takes float scales: the reference uses the values it computes with.
    scale = 1.f / std::sqrt(static_cast<float>(s.D));
    proxy_scale = 1.f / std::sqrt(static_cast<float>(s.Dp));
  }

  Problem problem(DType dtype) const {
    Problem p;
    p.batch = s.B;
    p.seqlen = s.S;
    p.heads = s.H;
    p.kv_heads = s.Hk;
    p.proxy_heads = s.Hp;
    p.proxy_kv_heads = s.Hpk;
    p.head_dim = s.D;
    p.proxy_head_dim = s.Dp;
    p.top_k = s.K;
    p.scale = static_cast<float>(scale);
    p.proxy_scale = static_cast<float>(proxy_scale);
    p.dtype = dtype;
    if (!s.cu.empty()) {
      p.cu_seqlens = s.cu.data();
      p.num_docs = static_cast<int64_t>(s.cu.size()) - 1;
    }
    return p;
  }
};

// Host storage of a tensor in fp32 or fp64.
struct Store {
  DType dtype;
  std::vector<double> d;
  std::vector<float> f;
  Store(DType dt, const std::vector<double>& x) : dtype(dt) {
    if (dt == DType::kFloat64) {
      d = x;
    } else {
      f.assign(x.begin(), x.end());
    }
  }
  Store(DType dt, size_t n) : Store(dt, std::vector<double>(n, std::nan(""))) {}
  void* data() { return dtype == DType::kFloat64 ? static_cast<void*>(d.data()) : f.data(); }
  std::vector<double> values() const {
    return dtype == DType::kFloat64 ? d : std::vector<double>(f.begin(), f.end());
  }
  // As the float* of the params: double storage for float64 (cpu.h).
  float* stats() { return static_cast<float*>(data()); }
};

ConstView cview(Store& t, int64_t heads, int64_t S, int64_t C) {
  return contiguous_view<const void>(t.data(), heads, S, C);
}
MutView mview(Store& t, int64_t heads, int64_t S, int64_t C) {
  return contiguous_view<void>(t.data(), heads, S, C);
}

struct Result {
  std::vector<int32_t> indices;
  std::vector<double> out, lse, lse_proxy, dqp, dkp, dq, dk, dv;
  double kl = 0;
};

// select (unless `indices` is given), forward and backward of one mode in `dtype`.
Result run(const Data& in, DType dtype, bool warmup, const std::vector<int32_t>* indices = nullptr,
           bool backward = true) {
  const Shape& s = in.s;
  const Problem pr = in.problem(dtype);
  Store qp(dtype, in.qp), kp(dtype, in.kp), q(dtype, in.q), k(dtype, in.k), v(dtype, in.v),
      dout(dtype, in.dout);
  Result r;
  if (indices) {
    r.indices = *indices;
  } else {
    r.indices.assign(static_cast<size_t>(s.B * s.Hp * s.S * s.K), -7);
    cpu::select({pr, cview(qp, s.Hp, s.S, s.Dp), cview(kp, s.Hpk, s.S, s.Dp), r.indices.data()});
  }
  const size_t nq = static_cast<size_t>(s.B * s.H * s.S * s.D);
  Store out(dtype, nq), lse(dtype, static_cast<size_t>(s.B * s.H * s.S)),
      lse_proxy(dtype, static_cast<size_t>(s.B * s.Hp * s.S)), kl(dtype, 1),
      kl_grad(dtype, std::vector<double>{in.kl_grad});
  ForwardParams f;
  f.problem = pr;
  f.indices = warmup ? nullptr : r.indices.data();
  f.qp = cview(qp, s.Hp, s.S, s.Dp);
  f.kp = cview(kp, s.Hpk, s.S, s.Dp);
  f.q = cview(q, s.H, s.S, s.D);
  f.k = cview(k, s.Hk, s.S, s.D);
  f.v = cview(v, s.Hk, s.S, s.D);
  f.out = mview(out, s.H, s.S, s.D);
  f.lse = lse.stats();
  f.lse_proxy = lse_proxy.stats();
  f.kl = kl.stats();
  warmup ? cpu::warmup_forward(f) : cpu::sparse_forward(f);
  r.out = out.values();
  r.lse = lse.values();
  r.lse_proxy = lse_proxy.values();
  r.kl = kl.values()[0];
  if (!backward) return r;
  Store dqp(dtype, in.qp.size()), dkp(dtype, in.kp.size()), dq(dtype, in.q.size()),
      dk(dtype, in.k.size()), dv(dtype, in.v.size());
  BackwardParams b;
  b.problem = pr;
  b.indices = f.indices;
  b.qp = f.qp;
  b.kp = f.kp;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.out = cview(out, s.H, s.S, s.D);
  b.dout = cview(dout, s.H, s.S, s.D);
  b.lse = lse.stats();
  b.lse_proxy = lse_proxy.stats();
  b.kl_grad = kl_grad.stats();
  b.dqp = mview(dqp, s.Hp, s.S, s.Dp);
  b.dkp = mview(dkp, s.Hpk, s.S, s.Dp);
  b.dq = mview(dq, s.H, s.S, s.D);
  b.dk = mview(dk, s.Hk, s.S, s.D);
  b.dv = mview(dv, s.Hk, s.S, s.D);
  warmup ? cpu::warmup_backward(b) : cpu::sparse_backward(b);
  r.dqp = dqp.values();
  r.dkp = dkp.values();
  r.dq = dq.values();
  r.dk = dk.values();
  r.dv = dv.values();
  return r;
}

// The naive double forward and backward of SPEC sections 2-5 over the given indices (every
// visible key when warmup): gradients of sum(out * dout) + kl_grad * kl, the teacher detached.
Result reference(const Data& in, bool warmup, const std::vector<int32_t>& indices) {
  const Shape& s = in.s;
  std::vector<int64_t> start(static_cast<size_t>(s.B * s.S));
  for (int64_t t = 0; t < s.B * s.S; ++t) start[static_cast<size_t>(t)] = t / s.S * s.S;
  for (size_t d = 0; d + 1 < s.cu.size(); ++d)
    for (int64_t t = s.cu[d]; t < s.cu[d + 1]; ++t) start[static_cast<size_t>(t)] = s.cu[d];
  auto at = [&](const std::vector<double>& x, int64_t heads, int64_t C, int64_t b, int64_t h,
                int64_t i) { return &x[static_cast<size_t>(((b * heads + h) * s.S + i) * C)]; };
  auto mut = [&](std::vector<double>& x, int64_t heads, int64_t C, int64_t b, int64_t h,
                 int64_t i) { return &x[static_cast<size_t>(((b * heads + h) * s.S + i) * C)]; };
  Result r;
  r.indices = indices;
  r.out.assign(static_cast<size_t>(s.B * s.H * s.S * s.D), 0.0);
  r.dqp.assign(in.qp.size(), 0.0);
  r.dkp.assign(in.kp.size(), 0.0);
  r.dq.assign(in.q.size(), 0.0);
  r.dk.assign(in.k.size(), 0.0);
  r.dv.assign(in.v.size(), 0.0);
  const double kl_weight = in.kl_grad / double(s.B * s.Hp * s.S);
  r.lse.assign(static_cast<size_t>(s.B * s.H * s.S), 0.0);
  r.lse_proxy.assign(static_cast<size_t>(s.B * s.Hp * s.S), 0.0);
  const int64_t G = s.H / s.Hp;
  double kl = 0;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t p = 0; p < s.Hp; ++p)
      for (int64_t i = 0; i < s.S; ++i) {
        std::vector<int64_t> keys;
        const int32_t* row = &indices[static_cast<size_t>(((b * s.Hp + p) * s.S + i) * s.K)];
        for (int64_t j = start[static_cast<size_t>(b * s.S + i)] - b * s.S; j <= i; ++j)
          if (warmup || std::count(row, row + s.K, static_cast<int32_t>(j / kBlockSize)))
            keys.push_back(j);
        std::vector<double> teacher(keys.size(), 0.0);
        for (int64_t h = p * G; h < (p + 1) * G; ++h) {
          const int64_t kv = h / (s.H / s.Hk);
          std::vector<double> a(keys.size());
          for (size_t x = 0; x < keys.size(); ++x) {
            const double* qi = at(in.q, s.H, s.D, b, h, i);
            const double* kj = at(in.k, s.Hk, s.D, b, kv, keys[x]);
            double dot = 0;
            for (int64_t c = 0; c < s.D; ++c) dot += qi[c] * kj[c];
            a[x] = in.scale * dot;
          }
          const double mx = *std::max_element(a.begin(), a.end());
          double sum = 0;
          for (double ax : a) sum += std::exp(ax - mx);
          const double lse = mx + std::log(sum);
          r.lse[static_cast<size_t>((b * s.H + h) * s.S + i)] = lse;
          double* o = mut(r.out, s.H, s.D, b, h, i);
          for (size_t x = 0; x < keys.size(); ++x) {
            const double w = std::exp(a[x] - lse);
            teacher[x] += w / double(G);
            const double* vj = at(in.v, s.Hk, s.D, b, kv, keys[x]);
            for (int64_t c = 0; c < s.D; ++c) o[c] += w * vj[c];
          }
          // dv += P do; dS = P (do . v - do . out); dq = scale dS k; dk += scale dS q.
          const double* dout = at(in.dout, s.H, s.D, b, h, i);
          const double* qi = at(in.q, s.H, s.D, b, h, i);
          double delta = 0;
          for (int64_t c = 0; c < s.D; ++c) delta += dout[c] * o[c];
          for (size_t x = 0; x < keys.size(); ++x) {
            const double w = std::exp(a[x] - lse);
            const double* vj = at(in.v, s.Hk, s.D, b, kv, keys[x]);
            const double* kj = at(in.k, s.Hk, s.D, b, kv, keys[x]);
            double dp = 0;
            for (int64_t c = 0; c < s.D; ++c) dp += dout[c] * vj[c];
            const double ds = w * (dp - delta);
            double* dq = mut(r.dq, s.H, s.D, b, h, i);
            double* dk = mut(r.dk, s.Hk, s.D, b, kv, keys[x]);
            double* dv = mut(r.dv, s.Hk, s.D, b, kv, keys[x]);
            for (int64_t c = 0; c < s.D; ++c) {
              dv[c] += w * dout[c];
              dq[c] += in.scale * ds * kj[c];
              dk[c] += in.scale * ds * qi[c];
            }
          }
        }
        std::vector<double> sp(keys.size());
        for (size_t x = 0; x < keys.size(); ++x) {
          const double* qi = at(in.qp, s.Hp, s.Dp, b, p, i);
          const double* kj = at(in.kp, s.Hpk, s.Dp, b, p / (s.Hp / s.Hpk), keys[x]);
          double dot = 0;
          for (int64_t c = 0; c < s.Dp; ++c) dot += qi[c] * kj[c];
          sp[x] = in.proxy_scale * dot;
        }
        const double mx = *std::max_element(sp.begin(), sp.end());
        double sum = 0;
        for (double x : sp) sum += std::exp(x - mx);
        const double lse_p = mx + std::log(sum);
        r.lse_proxy[static_cast<size_t>((b * s.Hp + p) * s.S + i)] = lse_p;
        const int64_t pk = p / (s.Hp / s.Hpk);
        for (size_t x = 0; x < keys.size(); ++x) {
          if (teacher[x] > 0) kl += teacher[x] * (std::log(teacher[x]) - (sp[x] - lse_p));
          // d kl / d s = (softmax(s) - teacher) / N, through s = proxy_scale qp . kp.
          const double g = kl_weight * (std::exp(sp[x] - lse_p) - teacher[x]);
          const double* qi = at(in.qp, s.Hp, s.Dp, b, p, i);
          const double* kj = at(in.kp, s.Hpk, s.Dp, b, pk, keys[x]);
          double* dqp = mut(r.dqp, s.Hp, s.Dp, b, p, i);
          double* dkp = mut(r.dkp, s.Hpk, s.Dp, b, pk, keys[x]);
          for (int64_t c = 0; c < s.Dp; ++c) {
            dqp[c] += in.proxy_scale * g * kj[c];
            dkp[c] += in.proxy_scale * g * qi[c];
          }
        }
      }
  r.kl = kl / double(s.B * s.Hp * s.S);
  return r;
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

std::vector<Shape> shapes() {
  return {
      {1, 200, 4, 2, 2, 1, 16, 8, 1, {}},
      {1, 300, 4, 1, 4, 2, 8, 16, 2, {}},
      {2, 260, 4, 1, 2, 1, 8, 8, 2, {0, 100, 260, 390, 400, 520}},
      {1, 300, 64, 1, 1, 1, 8, 8, 2, {}},  // G = 64 main heads per proxy head
  };
}

class Float64 : public ::testing::TestWithParam<bool> {};  // parameter: warmup

TEST(Float64Dtype, NameAndSize) {
  EXPECT_STREQ(dtype_name(DType::kFloat64), "float64");
  EXPECT_EQ(dtype_size(DType::kFloat64), 8u);
}

// Element by element to `tol` of each tensor's largest value.
void expect_matches_reference(const Result& got, const Result& want, double tol) {
  const std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>>
      pairs[] = {{"out", {&got.out, &want.out}},
                 {"lse", {&got.lse, &want.lse}},
                 {"lse_proxy", {&got.lse_proxy, &want.lse_proxy}},
                 {"dqp", {&got.dqp, &want.dqp}},
                 {"dkp", {&got.dkp, &want.dkp}},
                 {"dq", {&got.dq, &want.dq}},
                 {"dk", {&got.dk, &want.dk}},
                 {"dv", {&got.dv, &want.dv}}};
  for (const auto& [name, tensors] : pairs) {
    const double scale = max_abs(*tensors.second);
    EXPECT_GT(scale, 0) << name;
    EXPECT_LE(max_diff(*tensors.first, *tensors.second), tol * scale) << name;
  }
  EXPECT_NEAR(got.kl, want.kl, tol * want.kl);
  EXPECT_GT(want.kl, 0);
}

TEST_P(Float64, MatchesDoubleReference) {
  const bool warmup = GetParam();
  uint32_t seed = 300;
  for (const Shape& shape : shapes()) {
    const Data in(shape, seed++);
    const Result got = run(in, DType::kFloat64, warmup);
    expect_matches_reference(got, reference(in, warmup, got.indices), 1e-12);
  }
}

// The fp32 run of the same problem misses the reference by far more than the float64 run's
// tolerance: the check above tells double from single precision.
TEST_P(Float64, FloatThirtyTwoIsFarFromIt) {
  const bool warmup = GetParam();
  const Data in(shapes()[1], 301);
  const Result r64 = run(in, DType::kFloat64, warmup);
  const Result r32 = run(in, DType::kFloat32, warmup, &r64.indices);
  const Result want = reference(in, warmup, r64.indices);
  EXPECT_GT(max_diff(r32.out, want.out), 1e-9 * max_abs(want.out));
  EXPECT_GT(max_diff(r32.dq, want.dq), 1e-9 * max_abs(want.dq));
  EXPECT_GT(max_diff(r32.dkp, want.dkp), 1e-9 * max_abs(want.dkp));
}

TEST_P(Float64, SelectionMatchesFloat32AndAgreesWithinFp32Rounding) {
  const bool warmup = GetParam();
  uint32_t seed = 400;
  for (const Shape& shape : shapes()) {
    const Data in(shape, seed++);
    const Result r32 = run(in, DType::kFloat32, warmup);
    const Result r64 = run(in, DType::kFloat64, warmup, &r32.indices);
    // Random scores are far apart at fp32 precision: both selections agree.
    EXPECT_EQ(run(in, DType::kFloat64, warmup, nullptr, false).indices, r32.indices);
    const std::vector<double> kl32{r32.kl}, kl64{r64.kl};
    const std::vector<std::pair<const std::vector<double>*, const std::vector<double>*>> pairs = {
        {&r32.out, &r64.out}, {&r32.lse, &r64.lse}, {&r32.lse_proxy, &r64.lse_proxy},
        {&kl32, &kl64},       {&r32.dqp, &r64.dqp}, {&r32.dkp, &r64.dkp},
        {&r32.dq, &r64.dq},   {&r32.dk, &r64.dk},   {&r32.dv, &r64.dv}};
    for (const auto& [a, b] : pairs) {
      const double diff = max_diff(*a, *b), scale = max_abs(*b);
      EXPECT_LE(diff, 1e-4 * (1 + scale));
      EXPECT_GT(diff, 0) << "fp32 and fp64 runs should differ by rounding";
    }
  }
}

// Directional derivatives of L = sum(out * dout) (main inputs) and L = w * kl (proxy inputs;
// the KL's teacher is detached, SPEC 3) against double central differences.
TEST_P(Float64, GradientsMatchCentralDifferencesTightly) {
  const bool warmup = GetParam();
  uint32_t seed = 500;
  for (const Shape& shape : shapes()) {
    const Data in(shape, seed++);
    const Result base = run(in, DType::kFloat64, warmup);
    std::mt19937 rng(seed * 7);
    std::normal_distribution<double> normal;
    const std::pair<std::vector<double> Data::*, const std::vector<double>*> inputs[] = {
        {&Data::qp, &base.dqp},
        {&Data::kp, &base.dkp},
        {&Data::q, &base.dq},
        {&Data::k, &base.dk},
        {&Data::v, &base.dv}};
    for (int w = 0; w < 5; ++w) {
      const bool main = w >= 2;
      auto loss = [&](const Data& x) {
        const Result r = run(x, DType::kFloat64, warmup, &base.indices, false);
        if (!main) return in.kl_grad * r.kl;
        double l = 0;
        for (size_t i = 0; i < r.out.size(); ++i) l += r.out[i] * in.dout[i];
        return l;
      };
      const std::vector<double>& grad = *inputs[w].second;
      std::vector<double> dir(grad.size());
      for (double& x : dir) x = normal(rng);
      double analytic = 0, norm_g = 0, norm_d = 0;
      for (size_t i = 0; i < dir.size(); ++i) {
        analytic += grad[i] * dir[i];
        norm_g += grad[i] * grad[i];
        norm_d += dir[i] * dir[i];
      }
      const double h = 1e-5 / std::sqrt(norm_d);
      Data plus = in, minus = in;
      std::vector<double>& xp = plus.*inputs[w].first;
      std::vector<double>& xm = minus.*inputs[w].first;
      for (size_t i = 0; i < dir.size(); ++i) {
        xp[i] += h * dir[i];
        xm[i] -= h * dir[i];
      }
      const double numeric = (loss(plus) - loss(minus)) / (2 * h);
      const double bound = 3e-8 * std::sqrt(norm_g) * std::sqrt(norm_d);
      EXPECT_NEAR(analytic, numeric, bound) << "input " << w << " warmup " << warmup;
      EXPECT_GT(norm_g, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, Float64, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "warmup" : "sparse"; });

}  // namespace
}  // namespace flash_msa::test
