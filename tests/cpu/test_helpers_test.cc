// The test helpers themselves: the bf16/fp16 conversions that the dtype tests rely on, the
// strided buffers (every logical element lands at its own offset; padding stays poisoned), and
// the rest of common/host_data.h, which tools/msa_step.cc shares (element access, the
// counter-based random values, the FNV-1a digest of its checksum lines).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "common/problem.h"

namespace flash_msa::test {
namespace {

TEST(TestHelpers, Fp16KnownValues) {
  EXPECT_EQ(float_to_fp16(1.f), 0x3c00);
  EXPECT_EQ(float_to_fp16(-2.f), 0xc000);
  EXPECT_EQ(float_to_fp16(65504.f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65520.f), 0x7c00);                         // rounds to infinity
  EXPECT_EQ(float_to_fp16(std::ldexp(1.f, -24)), 0x0001);            // smallest subnormal
  EXPECT_EQ(float_to_fp16(std::ldexp(1.f, -14)), 0x0400);            // smallest normal
  EXPECT_EQ(float_to_fp16(1.f + std::ldexp(1.f, -11)), 0x3c00);      // tie: to even
  EXPECT_EQ(float_to_fp16(1.f + 3 * std::ldexp(1.f, -11)), 0x3c02);  // tie: to even
  EXPECT_EQ(fp16_to_float(0x3555), 0.333251953125f);
}

TEST(TestHelpers, Fp16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) continue;  // inf / NaN
    ASSERT_EQ(float_to_fp16(fp16_to_float(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(TestHelpers, Bf16KnownValuesAndRoundTrip) {
  EXPECT_EQ(float_to_bf16(1.f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-3.f), 0xc040);
  EXPECT_EQ(float_to_bf16(1.f + std::ldexp(1.f, -8)), 0x3f80);      // tie: to even
  EXPECT_EQ(float_to_bf16(1.f + 3 * std::ldexp(1.f, -8)), 0x3f82);  // tie: to even
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(kNaN))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7f80) == 0x7f80) continue;
    ASSERT_EQ(float_to_bf16(bf16_to_float(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(TestHelpers, RoundingIsNearest) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 10.f);
  for (int n = 0; n < 10000; ++n) {
    const float x = normal(rng);
    const float b = round_to(DType::kBFloat16, x), h = round_to(DType::kFloat16, x);
    ASSERT_LE(std::fabs(b - x), std::ldexp(std::fabs(x), -8)) << x;
    ASSERT_LE(std::fabs(h - x), std::ldexp(std::fabs(x), -11) + 3e-8f)
        << x;  // + half a subnormal ulp
  }
}

TEST(TestHelpers, TokenMajorBufferRoundTripsAndKeepsPaddingPoisoned) {
  std::mt19937 rng(2);
  const Tensor t = random_tensor(2, 3, 5, 4, rng);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const Buffer buf = Buffer::from(t, dtype, Layout::kTokenMajor);
    const Tensor back = buf.to_tensor();
    for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(back.v[i], round_to(dtype, t.v[i]));
    EXPECT_EQ(buf.nan_count(), 0);
    EXPECT_EQ(buf.padding_written(), 0);
    std::set<int64_t> offsets;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t s = 0; s < 5; ++s)
          for (int64_t c = 0; c < 4; ++c) offsets.insert(buf.offset(b, h, s, c));
    EXPECT_EQ(offsets.size(), t.size());  // no two logical elements share memory
    const ConstView v = buf.cview();
    EXPECT_LT(v.stride_h, v.stride_s);  // token-major: heads inside a token row
  }
}

TEST(TestHelpers, ElementsRoundTripInEveryDtype) {
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    EXPECT_EQ(host::element_size(dtype), dtype_size(dtype));
    std::vector<unsigned char> bytes(4 * host::element_size(dtype));
    const float values[4] = {1.f, -0.375f, 3.140625f, -1024.f};  // exact in every dtype
    for (int64_t i = 0; i < 4; ++i) host::store_element(dtype, bytes.data(), i, values[i]);
    for (int64_t i = 0; i < 4; ++i)
      EXPECT_EQ(host::load_element(dtype, bytes.data(), i), values[i]);
  }
}

TEST(TestHelpers, CounterUniformIsReproducibleWithUnitVariance) {
  constexpr int kCount = 200000;
  double sum = 0, sum_sq = 0;
  for (uint64_t i = 0; i < kCount; ++i) {
    const float x = host::counter_uniform(7, 3, i);
    ASSERT_EQ(x, host::counter_uniform(7, 3, i));
    ASSERT_GE(std::fabs(x), 1e-3f);
    ASSERT_LT(std::fabs(x), 1.7320509f);
    sum += x;
    sum_sq += double(x) * x;
  }
  EXPECT_NEAR(sum / kCount, 0.0, 0.01);
  EXPECT_NEAR(sum_sq / kCount, 1.0, 0.01);
  EXPECT_NE(host::counter_uniform(7, 3, 0), host::counter_uniform(7, 4, 0));  // streams differ
  EXPECT_NE(host::counter_uniform(7, 3, 0), host::counter_uniform(8, 3, 0));  // seeds differ
}

TEST(TestHelpers, Fnv1a64KnownValues) {
  EXPECT_EQ(host::fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(host::fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(host::fnv1a64("foobar", 6), 0x85944171f73967e8ull);
  EXPECT_EQ(host::fnv1a64("bar", 3, host::fnv1a64("foo", 3)), 0x85944171f73967e8ull);  // continued
}

}  // namespace
}  // namespace flash_msa::test
