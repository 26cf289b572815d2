// FLASH_MSA_NUM_THREADS (include/flash_msa/cpu.h): a whole number in [1, 65536] sets the default
// thread count; any other value makes the operations that use the default throw flash_msa::Error
// naming the variable and the value, instead of being ignored.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "flash_msa/cpu.h"
#include "flash_msa/msa.h"

namespace flash_msa::test {
namespace {

// Sets the variable for one test and restores the previous state afterwards.
class ScopedEnv {
 public:
  explicit ScopedEnv(const char* value) {
    if (const char* old = std::getenv(kName)) old_ = old;
    ::setenv(kName, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(kName, old_->c_str(), 1);
    } else {
      ::unsetenv(kName);
    }
  }

 private:
  static constexpr const char* kName = "FLASH_MSA_NUM_THREADS";
  std::optional<std::string> old_;
};

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(NumThreadsEnv, ValidValuesSetTheDefault) {
  cpu::set_num_threads(0);
  for (const char* value : {"1", "3", "16", "+2"}) {
    const ScopedEnv env(value);
    EXPECT_EQ(cpu::num_threads(), std::stoi(value)) << value;
  }
  const ScopedEnv empty("");  // counts as unset
  EXPECT_GE(cpu::num_threads(), 1);
}

TEST(NumThreadsEnv, InvalidValuesAreErrors) {
  cpu::set_num_threads(0);
  for (const char* value : {"abc", "0", "-1", "4x", "1.5", " ", "65537", "99999999999999999999"}) {
    const ScopedEnv env(value);
    EXPECT_MSA_ERROR(cpu::num_threads(), "FLASH_MSA_NUM_THREADS");
    const std::string msg = message_of([] { cpu::num_threads(); });
    EXPECT_NE(msg.find(std::string("got \"") + value + "\""), std::string::npos) << msg;
  }
}

TEST(NumThreadsEnv, AnOperationReportsTheBadValue) {
  cpu::set_num_threads(0);
  const ScopedEnv env("abc");
  Problem p;
  p.batch = p.heads = p.kv_heads = p.proxy_heads = p.proxy_kv_heads = 1;
  p.seqlen = 4;
  p.head_dim = p.proxy_head_dim = 2;
  p.top_k = 1;
  p.scale = p.proxy_scale = 1.f;
  p.dtype = DType::kFloat32;
  std::vector<float> qp(8, 1.f), kp(8, 1.f);
  std::vector<int32_t> indices(4, 0);
  const SelectParams params{p, contiguous_view<const void>(qp.data(), 1, 4, 2),
                            contiguous_view<const void>(kp.data(), 1, 4, 2), indices.data()};
  EXPECT_MSA_ERROR(cpu::select(params), "FLASH_MSA_NUM_THREADS");
  // An explicit count does not read the variable.
  cpu::set_num_threads(2);
  EXPECT_MSA_OK(cpu::select(params));
  EXPECT_EQ(indices, std::vector<int32_t>(4, 0));
  cpu::set_num_threads(0);
}

}  // namespace
}  // namespace flash_msa::test
