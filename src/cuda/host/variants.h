// The choice of each stage's kernels, made once per call (cuda.h: Chip, explain): one function
// per stage maps (chip, problem, options) to its variant and the reason, the host entries follow
// it and explain() reports it. What each Hopper folder's kernels take is declared next to them
// (the *_takes functions of forward/sm90, backward/sm90, select/sm90 and warmup/sm90).
#pragma once

#include <string>

#include "flash_msa/cuda.h"

namespace flash_msa::cuda {

struct KernelsChoice {
  Kernels kernels = Kernels::kPortable;
  std::string reason;
};

// select. The FP8 select runs on the Hopper kernel only: with fp8, a problem or chip it cannot
// run throws the entry point's error.
KernelsChoice select_variant(const Problem& pr, bool fp8, const Chip& chip);

struct SparseForwardVariant {
  KernelsChoice main;  // the key-outer main kernel
  bool proxy_in_main = false;  // the Hopper kernel computes the proxy's per-edge lse (Dp = 128)
  bool tile_path = false;      // same-selection query tiles run query-outer (dense forward)
  std::string proxy_reason, tile_reason;
};
SparseForwardVariant sparse_forward_variant(const Problem& pr, bool kl_value, const Chip& chip);

KernelsChoice sparse_backward_variant(const Problem& pr, const Chip& chip);

// Warmup's forward and backward (the forward's KL value also runs the portable forward).
KernelsChoice warmup_variant(const Problem& pr, const Chip& chip);

}  // namespace flash_msa::cuda
