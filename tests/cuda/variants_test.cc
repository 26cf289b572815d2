// The choice of each stage's kernels (cuda::explain over a given chip, host/variants.cu): which
// variant each part of a call takes on each kind of chip and problem, and why. Pure host logic:
// no GPU is needed.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "flash_msa/cuda.h"
#include "flash_msa/msa.h"

namespace flash_msa::test {
namespace {

const cuda::Chip kHopper{.compute_major = 9, .hopper_code = true, .portable_forced = false};

Problem problem(int64_t d, int64_t dp) {
  return {.batch = 1, .seqlen = 4096, .heads = 64, .kv_heads = 4, .proxy_heads = 4,
          .proxy_kv_heads = 1, .head_dim = d, .proxy_head_dim = dp, .top_k = 16,
          .dtype = DType::kBFloat16};
}

// stage -> "variant: reason"
std::map<std::string, std::string> choices(const Problem& pr, const cuda::CallOptions& options,
                                           const cuda::Chip& chip) {
  std::map<std::string, std::string> out;
  for (const cuda::StageChoice& c : cuda::explain(pr, options, chip))
    out[c.stage] = c.variant + ": " + c.reason;
  return out;
}

std::string variant(const std::map<std::string, std::string>& c, const std::string& stage) {
  const auto it = c.find(stage);
  if (it == c.end()) return "(absent)";
  return it->second.substr(0, it->second.find(':'));
}

TEST(Variants, HopperAtThePaperHeads) {
  const auto c = choices(problem(128, 128), {}, kHopper);
  EXPECT_EQ(variant(c, "select"), "hopper");
  EXPECT_EQ(variant(c, "sparse_forward"), "hopper");
  EXPECT_EQ(variant(c, "forward_proxy_lse"), "in the main kernel");
  EXPECT_EQ(variant(c, "forward_tile_path"), "on");
  EXPECT_EQ(variant(c, "sparse_backward"), "hopper");
  EXPECT_EQ(variant(c, "proxy_gradient"), "portable");
  EXPECT_EQ(variant(c, "forward_kl_value"), "(absent)");
  // In the order the call runs them.
  const auto list = cuda::explain(problem(128, 128), {}, kHopper);
  ASSERT_EQ(list.size(), 6u);
  EXPECT_EQ(list.front().stage, "select");
  EXPECT_EQ(list.back().stage, "proxy_gradient");
}

TEST(Variants, TheKlValueInTheForwardTurnsTheTilePathOff) {
  const auto c = choices(problem(128, 128), {.kl_value_in_forward = true}, kHopper);
  EXPECT_EQ(variant(c, "forward_tile_path"), "off");
  EXPECT_NE(c.at("forward_tile_path").find("KL value"), std::string::npos);
  EXPECT_EQ(variant(c, "forward_kl_value"), "portable");
}

TEST(Variants, HeadDimsTheHopperKernelsDoNotTake) {
  auto c = choices(problem(64, 64), {}, kHopper);
  EXPECT_EQ(variant(c, "select"), "hopper");  // Dp = 64
  EXPECT_EQ(variant(c, "sparse_forward"), "portable");
  EXPECT_NE(c.at("sparse_forward").find("takes D = 128"), std::string::npos);
  EXPECT_EQ(variant(c, "forward_proxy_lse"), "proxy kernel (portable)");
  EXPECT_EQ(variant(c, "sparse_backward"), "portable");
  c = choices(problem(128, 64), {}, kHopper);
  EXPECT_EQ(variant(c, "sparse_forward"), "hopper");
  EXPECT_EQ(variant(c, "forward_proxy_lse"), "proxy kernel (portable)");
  EXPECT_EQ(variant(c, "forward_tile_path"), "off");
  EXPECT_NE(c.at("forward_tile_path").find("D = Dp = 128"), std::string::npos);
  c = choices(problem(32, 32), {}, kHopper);
  EXPECT_EQ(variant(c, "select"), "portable");
  EXPECT_NE(c.at("select").find("Dp = 64 or 128"), std::string::npos);
}

TEST(Variants, ChipsThatRunThePortableKernels) {
  const std::map<std::string, cuda::Chip> chips = {
      {"compute capability 8", {.compute_major = 8, .hopper_code = true}},
      {"compute capability 10", {.compute_major = 10, .hopper_code = true}},
      {"no sm_90a code", {.compute_major = 9, .hopper_code = false}},
      {"FLASH_MSA_PORTABLE_KERNELS", {.compute_major = 9, .hopper_code = true,
                                      .portable_forced = true}},
      {"no CUDA device", {}},
  };
  for (const auto& [why, chip] : chips) {
    SCOPED_TRACE(why);
    for (bool warmup : {false, true}) {
      for (const cuda::StageChoice& c :
           cuda::explain(problem(128, 128), {.warmup = warmup}, chip)) {
        SCOPED_TRACE(c.stage);
        EXPECT_TRUE(c.variant == "portable" || c.variant == "off" ||
                    c.variant == "proxy kernel (portable)")
            << c.variant;
        if (c.variant != "proxy kernel (portable)" && c.stage != "proxy_gradient" &&
            c.stage != "forward_tile_path")
          EXPECT_NE(c.reason.find(why), std::string::npos) << c.reason;
      }
    }
  }
}

TEST(Variants, Warmup) {
  auto c = choices(problem(128, 128), {.warmup = true}, kHopper);
  EXPECT_EQ(variant(c, "warmup_forward"), "hopper");
  EXPECT_EQ(variant(c, "warmup_backward"), "hopper");
  EXPECT_EQ(variant(c, "select"), "(absent)");
  c = choices(problem(128, 128), {.warmup = true, .kl_value_in_forward = true}, kHopper);
  EXPECT_EQ(variant(c, "forward_kl_value"), "portable");
  c = choices(problem(128, 64), {.warmup = true}, kHopper);
  EXPECT_EQ(variant(c, "warmup_forward"), "portable");
  EXPECT_NE(c.at("warmup_forward").find("D = Dp = 128"), std::string::npos);
}

TEST(Variants, TheFp8SelectRunsOnHopperOnly) {
  const auto c = choices(problem(128, 128), {.fp8_select = true}, kHopper);
  EXPECT_EQ(variant(c, "select"), "hopper");
  EXPECT_NE(c.at("select").find("FP8"), std::string::npos);
  const cuda::Chip ampere{.compute_major = 8, .hopper_code = true};
  try {
    cuda::explain(problem(128, 128), {.fp8_select = true}, ampere);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("flash_msa: precision: expected exact here, got "
                                         "float8_e4m3"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("compute capability 8.x"), std::string::npos);
  }
  EXPECT_THROW(cuda::explain(problem(128, 64), {.fp8_select = true}, kHopper), Error);
}

// The public per-stage queries report the current chip's choice, as explain does.
TEST(Variants, TheKernelQueriesFollowTheChoice) {
  const Problem pr = problem(128, 128);
  const auto c = choices(pr, {}, cuda::current_chip());
  EXPECT_EQ(variant(c, "sparse_forward"), cuda::kernels_name(cuda::sparse_kernels(pr)));
  EXPECT_EQ(variant(c, "select"), cuda::kernels_name(cuda::select_kernels(pr)));
  const auto w = choices(pr, {.warmup = true}, cuda::current_chip());
  EXPECT_EQ(variant(w, "warmup_forward"), cuda::kernels_name(cuda::warmup_kernels(pr)));
}

}  // namespace
}  // namespace flash_msa::test
