// The CPU forward against the float64 reference in common/reference.h on random shapes (GQA,
// Hpk > 1, Dp != D, ragged S, packed documents, K > blocks), with its own indices and with
// arbitrary user-supplied ones (the decomposed API).
//
// Tolerance: fp32 accumulation over at most ~700 keys of unit-scale terms gives errors ~1e-6;
// 2e-5 of the largest value leaves room while any wrong key set or scale is O(1e-1).
#include "common/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/problem.h"

namespace flash_msa::test {
namespace {

struct RefCase {
  const char* name;
  Dims d;
  std::vector<int32_t> cuts;
};

void PrintTo(const RefCase& c, std::ostream* os) { *os << c.name; }

void expect_matches_reference(const Config& cfg, const Inputs& in, bool warmup,
                              const std::vector<int32_t>& idx) {
  const Outputs o = run_forward(cfg, in, warmup, idx);
  const RefForward r = ref_forward(cfg, in, warmup, idx);
  EXPECT_CLOSE(o.out.v, r.out, 2e-5, 1e-6);
  EXPECT_CLOSE(o.lse, r.lse, 2e-6, 2e-6);
  EXPECT_CLOSE(o.lse_proxy, r.lse_proxy, 2e-6, 2e-6);
  EXPECT_NEAR(o.kl, r.kl, 2e-5 * r.kl + 1e-7);
}

class ForwardReference : public ::testing::TestWithParam<std::tuple<RefCase, bool>> {};

TEST_P(ForwardReference, MatchesFloat64) {
  const auto& [rc, warmup] = GetParam();
  Config cfg;
  cfg.d = rc.d;
  if (!rc.cuts.empty()) cfg.cu_seqlens = make_cu_seqlens(rc.d, rc.cuts);
  const Inputs in = random_inputs(cfg.d, 2024 + static_cast<uint32_t>(rc.d.S + rc.d.H));
  const std::vector<int32_t> idx = warmup ? std::vector<int32_t>{} : run_select(cfg, in);
  expect_matches_reference(cfg, in, warmup, idx);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, ForwardReference,
    ::testing::Combine(
        ::testing::Values(
            RefCase{
                "gqa_S200",
                {.B = 2, .S = 200, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 1},
                {}},
            RefCase{
                "hpk2_S700",
                {.B = 1, .S = 700, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 2, .D = 32, .Dp = 16, .K = 2},
                {}},
            RefCase{
                "dp_gt_d_S300",
                {.B = 1, .S = 300, .H = 6, .Hk = 3, .Hp = 3, .Hpk = 3, .D = 8, .Dp = 64, .K = 2},
                {}},
            RefCase{
                "d64_S129",
                {.B = 2, .S = 129, .H = 2, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 64, .Dp = 8, .K = 1},
                {}},
            RefCase{
                "K_gt_blocks",
                {.B = 1, .S = 300, .H = 2, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 16, .Dp = 16, .K = 7},
                {}},
            RefCase{
                "varlen",
                {.B = 2, .S = 400, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 16, .K = 2},
                {1, 129, 255, 256, 500, 799}},
            RefCase{"S1",
                    {.B = 2, .S = 1, .H = 2, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 8, .K = 1},
                    {}}),
        ::testing::Bool()),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) +
             (std::get<1>(info.param) ? "_warmup" : "_sparse");
    });

// Any valid index set works, not just select's: random subsets of the visible blocks (own block
// always, fewer than K entries padded with -1).
TEST(ForwardReference, UserSuppliedIndices) {
  Config cfg;
  cfg.d = {.B = 1, .S = 650, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 3};
  const Inputs in = random_inputs(cfg.d, 7);
  std::mt19937 rng(8);
  std::vector<int32_t> idx(cfg.index_count(), -1);
  for (int64_t p = 0; p < cfg.d.Hp; ++p)
    for (int64_t i = 0; i < cfg.d.S; ++i) {
      const int32_t own = static_cast<int32_t>(i / kBlockSize);
      std::vector<int32_t> blocks;
      for (int32_t n = 0; n < own; ++n)
        if (rng() % 3 == 0 && static_cast<int64_t>(blocks.size()) < cfg.d.K - 1)
          blocks.push_back(n);
      blocks.push_back(own);
      std::copy(blocks.begin(), blocks.end(), idx.begin() + (p * cfg.d.S + i) * cfg.d.K);
    }
  expect_matches_reference(cfg, in, false, idx);
}

// Scores far beyond fp32 exp range (|a| ~ 100s): the softmax statistics must subtract a running
// maximum, and the backward must stay finite.
TEST(ForwardReference, LargeScoresStayFinite) {
  Config cfg;
  cfg.d = {.B = 1, .S = 300, .H = 2, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 16, .Dp = 16, .K = 2};
  Inputs in = random_inputs(cfg.d, 13);
  for (Tensor* t : {&in.q, &in.qp}) {
    for (float& x : t->v) x *= 25.f;
  }
  for (bool warmup : {false, true}) {
    SCOPED_TRACE(warmup ? "warmup" : "sparse");
    const std::vector<int32_t> idx = warmup ? std::vector<int32_t>{} : run_select(cfg, in);
    const Outputs o = run_forward(cfg, in, warmup, idx);
    const RefForward r = ref_forward(cfg, in, warmup, idx);
    double max_lse = 0;
    for (float x : r.lse) max_lse = std::max(max_lse, double(x));
    ASSERT_GT(max_lse, 100.0);  // exp would overflow fp32 without the max subtraction
    EXPECT_CLOSE(o.out.v, r.out, 2e-5, 1e-5);
    EXPECT_CLOSE(o.lse, r.lse, 2e-6, 2e-6);
    EXPECT_CLOSE(o.lse_proxy, r.lse_proxy, 2e-6, 2e-6);
    EXPECT_NEAR(o.kl, r.kl, 1e-4 * r.kl);
    const float w = 0.7f;
    const Grads g = run_backward(cfg, in, o, warmup, idx, &w);
    for (const Tensor* t : {&g.dqp, &g.dkp, &g.dq, &g.dk, &g.dv}) {
      int64_t bad = 0;
      for (float x : t->v) bad += !std::isfinite(x);
      EXPECT_EQ(bad, 0);
    }
  }
}

// SPEC 1 lets an implementation require each proxy group to lie inside one kv group (Hp a
// multiple of Hk) if its error says so; otherwise the results must be right.
TEST(ForwardReference, ProxyGroupSpanningKvGroups) {
  Config cfg;
  cfg.d = {.B = 1, .S = 200, .H = 4, .Hk = 4, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 8, .K = 1};
  const Inputs in = random_inputs(cfg.d, 9);
  for (bool warmup : {false, true}) {
    bool rejected = false;
    std::vector<int32_t> idx;
    try {
      if (!warmup) idx = run_select(cfg, in);
      run_forward(cfg, in, warmup, idx);
    } catch (const flash_msa::Error& e) {
      rejected = true;
      const std::string msg = e.what();
      EXPECT_TRUE(msg.find("flash_msa: proxy_heads:") != std::string::npos ||
                  msg.find("flash_msa: kv_heads:") != std::string::npos)
          << msg;
    }
    if (!rejected) expect_matches_reference(cfg, in, warmup, idx);
  }
}

}  // namespace
}  // namespace flash_msa::test
