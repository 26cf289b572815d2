// Selection (SPEC section 1): format of the indices, the own block, and top-K by max-pooled score
// checked against float64 block scores computed in the test.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "common/problem.h"
#include "common/reference.h"

namespace flash_msa::test {
namespace {

struct SelectCase {
  const char* name;
  Dims d;
  std::vector<int32_t> cuts;
};

void PrintTo(const SelectCase& c, std::ostream* os) { *os << c.name; }

class SelectByScore : public ::testing::TestWithParam<SelectCase> {};

TEST_P(SelectByScore, TopKOfMaxPooledScoresWithOwnBlock) {
  const SelectCase& sc = GetParam();
  Config cfg;
  cfg.d = sc.d;
  if (!sc.cuts.empty()) cfg.cu_seqlens = make_cu_seqlens(sc.d, sc.cuts);
  const Inputs in = random_inputs(cfg.d, 42 + static_cast<uint32_t>(sc.d.S * sc.d.K));
  const std::vector<int32_t> idx = run_select(cfg, in);
  std::string first;
  // fp32 scores of unit-scale inputs differ from float64 by ~1e-6; 1e-4 only excuses near-ties.
  EXPECT_EQ(selection_errors(cfg, in, idx, 1e-4, &first), 0) << first;
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, SelectByScore,
    ::testing::Values(
        SelectCase{"S700_K2",
                   {.B = 1, .S = 700, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 16, .K = 2},
                   {}},
        SelectCase{"S700_K3_hpk2",
                   {.B = 1, .S = 700, .H = 4, .Hk = 2, .Hp = 4, .Hpk = 2, .D = 8, .Dp = 8, .K = 3},
                   {}},
        SelectCase{"S200_K1",
                   {.B = 2, .S = 200, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 32, .K = 1},
                   {}},
        SelectCase{"K_gt_blocks",
                   {.B = 2, .S = 300, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 8, .K = 5},
                   {}},
        SelectCase{"S1",
                   {.B = 3, .S = 1, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 8, .K = 2},
                   {}},
        SelectCase{"S128_exact_block",
                   {.B = 1, .S = 256, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 8, .K = 1},
                   {}},
        SelectCase{"varlen_straddling",
                   {.B = 2, .S = 600, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 8, .K = 2},
                   {130, 300, 301, 700, 1000}},
        SelectCase{"varlen_K_gt_visible",
                   {.B = 1, .S = 640, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 8, .K = 4},
                   {200, 390, 600}}),
    [](const auto& info) { return std::string(info.param.name); });

// Exact ties (every key identical, small-integer values so that every dot product is exact in any
// summation order): the lower block index wins.
TEST(Select, TiesGoToTheLowerBlock) {
  Config cfg;
  cfg.d = {.B = 1, .S = 600, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 8, .K = 3};
  Inputs in = random_inputs(cfg.d, 3);
  for (float& x : in.qp.v) x = std::round(x);
  for (int64_t j = 0; j < cfg.d.S; ++j)
    for (int64_t c = 0; c < cfg.d.Dp; ++c) in.kp.at(0, 0, j, c) = float(c % 3) - 1.f;
  const std::vector<int32_t> idx = run_select(cfg, in);
  for (int64_t i = 0; i < cfg.d.S; ++i) {
    const int32_t own = static_cast<int32_t>(i / kBlockSize);
    std::vector<int32_t> want;
    for (int32_t n = 0; n < own && static_cast<int64_t>(want.size()) < cfg.d.K - 1; ++n)
      want.push_back(n);
    want.push_back(own);
    while (static_cast<int64_t>(want.size()) < cfg.d.K) want.push_back(-1);
    const std::vector<int32_t> got(idx.begin() + i * cfg.d.K, idx.begin() + (i + 1) * cfg.d.K);
    ASSERT_EQ(got, want) << "query " << i;
  }
}

// A block whose best score is far above the others is picked by every later query of its proxy
// head.
TEST(Select, PlantedBlockIsSelected) {
  Config cfg;
  cfg.d = {.B = 1, .S = 700, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 8, .K = 2};
  Inputs in = random_inputs(cfg.d, 8);
  // Make every proxy query point along +e0 (plus noise), and one key of block 2 huge along +e0.
  for (int64_t p = 0; p < cfg.d.Hp; ++p)
    for (int64_t i = 0; i < cfg.d.S; ++i) in.qp.at(0, p, i, 0) = 3.f + 0.1f * in.qp.at(0, p, i, 0);
  in.kp.at(0, 0, 2 * kBlockSize + 17, 0) = 50.f;
  const std::vector<int32_t> idx = run_select(cfg, in);
  for (int64_t p = 0; p < cfg.d.Hp; ++p)
    for (int64_t i = 2 * kBlockSize + 17; i < cfg.d.S; ++i) {
      const int32_t* row = &idx[static_cast<size_t>((p * cfg.d.S + i) * cfg.d.K)];
      const int32_t own = static_cast<int32_t>(i / kBlockSize);
      if (own == 2) {
        EXPECT_TRUE(row[0] == 2 || row[1] == 2) << "p " << p << " i " << i;
      } else {
        EXPECT_EQ(row[0], 2) << "p " << p << " i " << i;
        EXPECT_EQ(row[1], own) << "p " << p << " i " << i;
      }
    }
}

// Selection is a function of the inputs only: same result on a second call and from a
// token-major strided layout.
TEST(Select, DeterministicAndLayoutIndependent) {
  Config cfg;
  cfg.d = {.B = 2, .S = 450, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 2, .D = 8, .Dp = 16, .K = 2};
  const Inputs in = random_inputs(cfg.d, 17);
  const std::vector<int32_t> a = run_select(cfg, in);
  const std::vector<int32_t> b = run_select(cfg, in);
  Config strided = cfg;
  strided.layout = Layout::kTokenMajor;
  const std::vector<int32_t> c = run_select(strided, in);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
}

// The FP8 select (SelectPrecision::kFloat8E4M3) ranks the scores of the proxies as their FP8
// quantisation dequantises them (quantised by brute force in the test), in every dtype, with
// token rows whose magnitudes span 2^-6 .. 2^6 and packed documents; on these inputs it is an
// approximation of the exact selection, not the same.
TEST(Select, Fp8RanksTheQuantisedScores) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
    SCOPED_TRACE(dtype_name(dtype));
    Config cfg;
    cfg.d = {.B = 2, .S = 1100, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 32, .K = 3};
    cfg.dtype = dtype;
    cfg.cu_seqlens = make_cu_seqlens(cfg.d, {700, 1500});
    Inputs in = random_inputs(cfg.d, 23, dtype);
    for (Tensor* t : {&in.qp, &in.kp})
      for (size_t x = 0; x < t->v.size(); ++x)
        t->v[x] *= std::ldexp(1.f, static_cast<int>(x / t->n3 % 13) - 6);
    const std::vector<int32_t> fp8 = run_select(cfg, in, SelectPrecision::kFloat8E4M3);
    std::string first;
    // fp32 scores of the dequantised values differ from float64 by ~1e-6 of their magnitude.
    EXPECT_EQ(selection_errors(cfg, fp8_inputs(in), fp8, 1e-4, &first), 0) << first;
    EXPECT_NE(fp8, run_select(cfg, in)) << "the FP8 select picked the exact selection everywhere";
  }
}

}  // namespace
}  // namespace flash_msa::test
