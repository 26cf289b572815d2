#include "cuda/host/variants.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/backward/sm90/sparse_sm90.h"
#include "cuda/forward/sm90/dense_sm90.h"
#include "cuda/forward/sm90/sparse_sm90.h"
#include "cuda/host/impl.h"
#include "cuda/host/limits.h"
#include "cuda/select/sm90/select_sm90.h"
#include "cuda/warmup/sm90/warmup_sm90.h"

namespace flash_msa::cuda {
namespace {

// The device's compute capability major, probed once per device and cached (0: none).
constexpr int kMaxDevices = 64;
std::array<std::atomic<int>, kMaxDevices> majors{};  // 0: not probed yet, -1: no device

int probe_major(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return major;
}

int current_major() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (device < 0 || device >= kMaxDevices) return std::max(probe_major(device), 0);
  int known = majors[device].load(std::memory_order_relaxed);
  if (known == 0) {
    known = probe_major(device);
    majors[device].store(known, std::memory_order_relaxed);
  }
  return std::max(known, 0);
}

bool hopper_code() {
  static const bool built = sm90::sparse_forward_built() && sm90::sparse_backward_built() &&
                            sm90::select_built() && sm90::warmup_built();
  return built;
}

bool portable_forced() {
  const char* value = std::getenv("FLASH_MSA_PORTABLE_KERNELS");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

// The Hopper kernels where the chip runs them and they take the problem (`takes`, whose
// requirement reads `needs`), else the portable ones; the reason names what decided.
KernelsChoice hopper_or_portable(const Chip& chip, bool takes, const char* needs) {
  if (chip.portable_forced)
    return {Kernels::kPortable, "FLASH_MSA_PORTABLE_KERNELS asks for the portable kernels"};
  if (chip.compute_major != 9)
    return {Kernels::kPortable,
            chip.compute_major == 0
                ? std::string("no CUDA device")
                : "compute capability " + std::to_string(chip.compute_major) +
                      ".x: the Hopper kernels need 9.x"};
  if (!chip.hopper_code)
    return {Kernels::kPortable,
            "this build holds no sm_90a code (FLASH_MSA_CUDA_ARCHS without 90a)"};
  if (!takes) return {Kernels::kPortable, std::string("the Hopper kernel takes ") + needs};
  return {Kernels::kHopper, std::string("compute capability 9.x, sm_90a code, ") + needs};
}

std::string dims(const Problem& pr) {
  return "D = " + std::to_string(pr.head_dim) + ", Dp = " + std::to_string(pr.proxy_head_dim);
}

}  // namespace

const char* kernels_name(Kernels kernels) {
  return kernels == Kernels::kHopper ? "hopper" : "portable";
}

Chip current_chip() {
  return {.compute_major = current_major(),
          .hopper_code = hopper_code(),
          .portable_forced = portable_forced()};
}

KernelsChoice select_variant(const Problem& pr, bool fp8, const Chip& chip) {
  KernelsChoice c = hopper_or_portable(chip, sm90::select_takes(pr), sm90::kSelectTakes);
  if (!fp8) return c;
  if (pr.proxy_head_dim != sm90::kSelectFp8Dp)
    limit_error("proxy_head_dim", "128 for the FP8 select (precision float8_e4m3)",
                std::to_string(pr.proxy_head_dim));
  if (c.kernels != Kernels::kHopper)
    throw Error(
        "flash_msa: precision: expected exact here, got float8_e4m3: the FP8 select runs on the "
        "Hopper select kernel, which needs a GPU of compute capability 9.x, a build with sm_90a "
        "code and FLASH_MSA_PORTABLE_KERNELS unset (here: " +
        c.reason + ")");
  c.reason = "FP8 (precision float8_e4m3) on the Hopper select kernel; " + c.reason;
  return c;
}

SparseForwardVariant sparse_forward_variant(const Problem& pr, bool kl_value, const Chip& chip) {
  SparseForwardVariant v;
  v.main = hopper_or_portable(chip, sm90::sparse_forward_takes(pr), sm90::kSparseForwardTakes);
  const bool hopper = v.main.kernels == Kernels::kHopper;
  v.proxy_in_main = hopper && sm90::sparse_forward_takes_proxy(pr);
  v.proxy_reason = v.proxy_in_main ? "the Hopper forward computes it along at Dp = 128"
                   : hopper        ? "the Hopper forward takes the proxy along at Dp = 128 only"
                                   : "the portable forward leaves it to the proxy kernel";
  v.tile_path = hopper && sm90::dense_forward_takes(pr) && !kl_value;
  v.tile_reason =
      v.tile_path ? "query tiles whose queries all selected the same blocks run query-outer"
      : !hopper   ? "the tile path runs with the Hopper kernels only"
      : !sm90::dense_forward_takes(pr)
          ? std::string("the dense forward takes ") + sm90::kDenseForwardTakes + ", here " +
                dims(pr)
          : "the KL value in the forward walks every token key-outer";
  return v;
}

KernelsChoice sparse_backward_variant(const Problem& pr, const Chip& chip) {
  return hopper_or_portable(chip, sm90::sparse_backward_takes(pr), sm90::kSparseBackwardTakes);
}

KernelsChoice warmup_variant(const Problem& pr, const Chip& chip) {
  // Warmup's forward is the dense forward, its backward the warmup backward: both Hopper or
  // both portable.
  return hopper_or_portable(chip, sm90::dense_forward_takes(pr) && sm90::warmup_backward_takes(pr),
                            sm90::kWarmupBackwardTakes);
}

std::vector<StageChoice> explain(const Problem& pr, const CallOptions& options,
                                 const Chip& chip) {
  std::vector<StageChoice> out;
  auto add = [&out](const char* stage, const char* variant, std::string reason) {
    out.push_back({stage, variant, std::move(reason)});
  };
  if (options.warmup) {
    const KernelsChoice w = warmup_variant(pr, chip);
    const bool hopper = w.kernels == Kernels::kHopper;
    add("warmup_forward", kernels_name(w.kernels), w.reason);
    if (options.kl_value_in_forward)
      add("forward_kl_value", "portable",
          hopper ? "the portable forward's second walk computes it (the outputs stay the Hopper "
                   "forward's)"
                 : "the portable forward's second walk");
    add("warmup_backward", kernels_name(w.kernels), w.reason);
    return out;
  }
  const KernelsChoice s = select_variant(pr, options.fp8_select, chip);
  add("select", kernels_name(s.kernels), s.reason);
  const SparseForwardVariant f = sparse_forward_variant(pr, options.kl_value_in_forward, chip);
  add("sparse_forward", kernels_name(f.main.kernels), f.main.reason);
  add("forward_proxy_lse", f.proxy_in_main ? "in the main kernel" : "proxy kernel (portable)",
      f.proxy_reason);
  add("forward_tile_path", f.tile_path ? "on" : "off", f.tile_reason);
  if (options.kl_value_in_forward)
    add("forward_kl_value", "portable", "the teacher pass and the proxy kernel's KL terms");
  const KernelsChoice b = sparse_backward_variant(pr, chip);
  add("sparse_backward", kernels_name(b.kernels), b.reason);
  add("proxy_gradient", "portable", "the proxy-gradient kernel has no Hopper version");
  return out;
}

std::vector<StageChoice> explain(const Problem& pr, const CallOptions& options) {
  return explain(pr, options, current_chip());
}

Kernels sparse_kernels(const Problem& problem) {
  return sparse_forward_variant(problem, false, current_chip()).main.kernels;
}

Kernels warmup_kernels(const Problem& problem) {
  return warmup_variant(problem, current_chip()).kernels;
}

Kernels select_kernels(const Problem& problem) {
  return select_variant(problem, false, current_chip()).kernels;
}

}  // namespace flash_msa::cuda
