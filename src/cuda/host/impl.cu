#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/host/impl.h"

namespace flash_msa::cuda {
namespace {

enum class Probe : int8_t { kUnknown = 0, kHopper, kPortable };
constexpr int kMaxDevices = 64;
std::array<std::atomic<Probe>, kMaxDevices> probes{};

// Hopper kernels can run on `device`: compute capability 9.x and sm_90a code for the kernels.
Probe probe(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return Probe::kPortable;
  }
  return major == 9 && sm90::sparse_forward_built() && sm90::sparse_backward_built() &&
                 sm90::select_built() && sm90::warmup_built()
             ? Probe::kHopper
             : Probe::kPortable;
}

bool device_runs_hopper() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (device < 0 || device >= kMaxDevices) return probe(device) == Probe::kHopper;
  Probe known = probes[device].load(std::memory_order_relaxed);
  if (known == Probe::kUnknown) {
    known = probe(device);
    probes[device].store(known, std::memory_order_relaxed);
  }
  return known == Probe::kHopper;
}

bool portable_forced() {
  const char* value = std::getenv("FLASH_MSA_PORTABLE_KERNELS");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

// The Hopper kernels unless the environment forces the portable ones or the device cannot run
// them.
Kernels hopper_unless_forced() {
  return portable_forced() || !device_runs_hopper() ? Kernels::kPortable : Kernels::kHopper;
}

}  // namespace

const char* kernels_name(Kernels kernels) {
  return kernels == Kernels::kHopper ? "hopper" : "portable";
}

Kernels sparse_kernels(const Problem& problem) {
  // The Hopper kernels are instantiated for D = 128 (forward/sm90, backward/sm90).
  return problem.head_dim == 128 ? hopper_unless_forced() : Kernels::kPortable;
}

Kernels warmup_kernels(const Problem& problem) {
  // The Hopper dense kernels are instantiated for D = Dp = 128 (forward/sm90/dense.cu and
  // warmup/sm90).
  return problem.head_dim == 128 && problem.proxy_head_dim == 128 ? hopper_unless_forced()
                                                                  : Kernels::kPortable;
}

Kernels select_kernels(const Problem& problem) {
  // The Hopper select is instantiated for Dp = 64 and 128 (select/sm90).
  const int64_t dp = problem.proxy_head_dim;
  return dp == 64 || dp == 128 ? hopper_unless_forced() : Kernels::kPortable;
}

}  // namespace flash_msa::cuda
