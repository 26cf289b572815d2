#include "cpu/parallel.h"

#include <cstdlib>
#include <string>

#include "flash_msa/cpu.h"
#include "flash_msa/msa.h"

namespace flash_msa::cpu {
namespace {

std::atomic<int> g_threads{0};  // 0: not set by the caller

int default_threads() {
  if (const char* env = std::getenv("FLASH_MSA_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
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
