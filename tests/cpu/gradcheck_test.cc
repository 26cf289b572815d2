// Finite-difference checks of every gradient of the CPU backend (SPEC section 4).
//
// Loss: L = sum(out * dout) + w * kl. The KL's target is detached (SPEC 3), so the true derivative
// of kl with respect to q, k, v (through the teacher) is deliberately absent from dq, dk, dv: the
// main inputs are checked against L_main = sum(out * dout) alone, the proxy inputs (which only kl
// depends on) against the full L. In sparse mode the indices come from one select() call and are
// fed to every perturbed forward, because the selection is piecewise constant in qp, kp.
//
// Tolerance: central differences in double of fp32 forwards. The truncation error is O(h^2)
// (~1e-4 relative at h = 1e-2 on unit-scale inputs) and the fp32 rounding noise of L divided by 2h
// is ~1e-4 of the directional derivative for these sizes, so 2e-2 leaves a wide margin while a
// wrong term (a missing scale, a wrong head mapping, a dropped key) changes <grad, dir> by O(1).
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/problem.h"

namespace flash_msa::test {
namespace {

struct GradCase {
  const char* name;
  Dims d;
  std::vector<int32_t> cuts;  // interior document boundaries over B*S (empty: no packing)
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

std::vector<GradCase> grad_cases() {
  return {
      {"gqa_ragged200",
       {.B = 1, .S = 200, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 1},
       {}},
      {"hpk2_dp16_S300",
       {.B = 1, .S = 300, .H = 4, .Hk = 1, .Hp = 4, .Hpk = 2, .D = 32, .Dp = 16, .K = 2},
       {}},
      {"varlen_dp24",
       {.B = 2, .S = 260, .H = 4, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 24, .K = 2},
       {100, 390, 400}},
      {"k_gt_blocks",
       {.B = 1, .S = 200, .H = 2, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 8, .K = 4},
       {}},
      {"gqa3_group2",
       {.B = 1, .S = 300, .H = 6, .Hk = 3, .Hp = 3, .Hpk = 1, .D = 16, .Dp = 16, .K = 2},
       {}},
      // A proxy group spanning two kv heads (Hp not a multiple of Hk; SPEC 1 lets a backend
      // refuse).
      {"proxy_group_spans_kv",
       {.B = 1, .S = 200, .H = 4, .Hk = 4, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 8, .K = 1},
       {}},
  };
}

constexpr float kKlWeight = 0.7f;

enum Which { kQp, kKp, kQ, kK, kV };
const char* which_name(int w) {
  static const char* names[] = {"qp", "kp", "q", "k", "v"};
  return names[w];
}
Tensor& input_of(Inputs& in, int w) {
  Tensor* t[] = {&in.qp, &in.kp, &in.q, &in.k, &in.v};
  return *t[w];
}
const Tensor& grad_of(const Grads& g, int w) {
  const Tensor* t[] = {&g.dqp, &g.dkp, &g.dq, &g.dk, &g.dv};
  return *t[w];
}
bool is_main(int w) { return w >= kQ; }

double loss(const Config& cfg, const Inputs& in, bool warmup, const std::vector<int32_t>& idx,
            bool main_only) {
  const Outputs o = run_forward(cfg, in, warmup, idx);
  double l = 0;
  for (size_t i = 0; i < o.out.size(); ++i) l += double(o.out.v[i]) * double(in.dout.v[i]);
  if (!main_only) l += double(kKlWeight) * double(o.kl);
  return l;
}

// Central difference of L along `dir` for input `w`.
double directional_fd(const Config& cfg, Inputs in, bool warmup, const std::vector<int32_t>& idx,
                      int w, const std::vector<float>& dir, float h) {
  Tensor& x = input_of(in, w);
  const std::vector<float> base = x.v;
  for (size_t i = 0; i < base.size(); ++i) x.v[i] = base[i] + h * dir[i];
  const double lp = loss(cfg, in, warmup, idx, is_main(w));
  for (size_t i = 0; i < base.size(); ++i) x.v[i] = base[i] - h * dir[i];
  const double lm = loss(cfg, in, warmup, idx, is_main(w));
  return (lp - lm) / (2.0 * double(h));
}

class GradCheck : public ::testing::TestWithParam<std::tuple<GradCase, bool>> {};

TEST_P(GradCheck, DirectionalDerivativesOfAllInputs) {
  const auto& [gc, warmup] = GetParam();
  Config cfg;
  cfg.d = gc.d;
  if (!gc.cuts.empty()) cfg.cu_seqlens = make_cu_seqlens(gc.d, gc.cuts);
  const Inputs in = random_inputs(cfg.d, 1234 + static_cast<uint32_t>(gc.d.S));
  if (gc.d.Hp % gc.d.Hk != 0) {
    try {
      run_forward(cfg, in, /*warmup=*/true, {});
    } catch (const flash_msa::Error& e) {
      const std::string msg = e.what();
      ASSERT_TRUE(msg.find("flash_msa: proxy_heads:") != std::string::npos ||
                  msg.find("flash_msa: kv_heads:") != std::string::npos)
          << msg;
      GTEST_SKIP() << "backend requires Hp % Hk == 0: " << msg;
    }
  }
  const std::vector<int32_t> idx = warmup ? std::vector<int32_t>{} : run_select(cfg, in);
  const Outputs fwd = run_forward(cfg, in, warmup, idx);
  const float w = kKlWeight;
  const Grads g = run_backward(cfg, in, fwd, warmup, idx, &w);

  std::mt19937 rng(99);
  std::normal_distribution<float> normal;
  for (int which = kQp; which <= kV; ++which) {
    SCOPED_TRACE(which_name(which));
    const Tensor& grad = grad_of(g, which);
    double gnorm = 0;
    for (float x : grad.v) gnorm += double(x) * double(x);
    gnorm = std::sqrt(gnorm);
    ASSERT_GT(gnorm, 0.0) << "gradient is identically zero";
    for (int rep = 0; rep < 2; ++rep) {
      std::vector<float> dir(grad.size());
      for (float& x : dir) x = normal(rng);
      double analytic = 0;
      for (size_t i = 0; i < dir.size(); ++i) analytic += double(grad.v[i]) * double(dir[i]);
      const float h = is_main(which) ? 1e-2f : 2e-2f;
      const double fd = directional_fd(cfg, in, warmup, idx, which, dir, h);
      EXPECT_NEAR(fd, analytic, 2e-2 * std::max(std::fabs(analytic), 0.25 * gnorm) + 1e-7)
          << "direction " << rep << " |grad| " << gnorm;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, GradCheck,
                         ::testing::Combine(::testing::ValuesIn(grad_cases()), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) +
                                  (std::get<1>(info.param) ? "_warmup" : "_sparse");
                         });

// Single elements: the largest-magnitude gradient entry and a few random ones of each input, on a
// small problem (150 proxy rows) so that one element moves kl well above fp32 rounding.
class GradCheckElements : public ::testing::TestWithParam<bool> {};

TEST_P(GradCheckElements, SingleElements) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 1, .S = 150, .H = 2, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 8, .K = 1};
  Inputs in = random_inputs(cfg.d, 777);
  const std::vector<int32_t> idx = warmup ? std::vector<int32_t>{} : run_select(cfg, in);
  const Outputs fwd = run_forward(cfg, in, warmup, idx);
  const float w = kKlWeight;
  const Grads g = run_backward(cfg, in, fwd, warmup, idx, &w);
  std::mt19937 rng(5);
  for (int which = kQp; which <= kV; ++which) {
    SCOPED_TRACE(which_name(which));
    const Tensor& grad = grad_of(g, which);
    size_t arg = 0;
    double gmax = 0;
    for (size_t i = 0; i < grad.size(); ++i)
      if (std::fabs(grad.v[i]) > gmax) gmax = std::fabs(grad.v[i]), arg = i;
    ASSERT_GT(gmax, 0.0);
    std::vector<size_t> picks = {arg};
    std::uniform_int_distribution<size_t> pick(0, grad.size() - 1);
    for (int r = 0; r < 3; ++r) picks.push_back(pick(rng));
    for (size_t e : picks) {
      const float h = 5e-2f;
      Tensor& x = input_of(in, which);
      const float base = x.v[e];
      x.v[e] = base + h;
      const double lp = loss(cfg, in, warmup, idx, is_main(which));
      x.v[e] = base - h;
      const double lm = loss(cfg, in, warmup, idx, is_main(which));
      x.v[e] = base;
      const double fd = (lp - lm) / (2.0 * double(h));
      EXPECT_NEAR(fd, grad.v[e], 3e-2 * std::fabs(grad.v[e]) + 3e-3 * gmax) << "element " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, GradCheckElements, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "warmup" : "sparse"; });

}  // namespace
}  // namespace flash_msa::test
