#include "cpu/parallel.h"

#include <cerrno>
#include <cstdlib>
#include <string>

#include "common/check.h"
#include "flash_msa/cpu.h"
#include "flash_msa/msa.h"

namespace flash_msa::cpu {
namespace {

std::atomic<int> g_threads{0};  // 0: not set by the caller

constexpr long kMaxThreads = 65536;

// FLASH_MSA_NUM_THREADS when set (a whole number in [1, kMaxThreads], else an error: a typo must
// not silently fall back to another thread count), else one thread per hardware thread.
int default_threads() {
  const char* env = std::getenv("FLASH_MSA_NUM_THREADS");
  if (env == nullptr || *env == '\0') return std::max(1u, std::thread::hardware_concurrency());
  errno = 0;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || errno == ERANGE || n < 1 || n > kMaxThreads) {
    std::string got = "\"";
    got.append(env).append("\"");
    fail("FLASH_MSA_NUM_THREADS",
         "a whole number of threads in [1, " + str(kMaxThreads) + "] (or the variable unset)", got);
  }
  return static_cast<int>(n);
}

}  // namespace

int num_threads() {
  const int set = g_threads.load();
  return set > 0 ? set : default_threads();
}

void set_num_threads(int threads) {
  if (threads < 0)
    throw Error("flash_msa: threads: expected >= 0 (0 restores the default), got " +
                std::to_string(threads));
  g_threads.store(threads);
}

}  // namespace flash_msa::cpu
