// Workspace sizes of the warmup (dense) entries, for the stage entries' *_workspace_bytes.
#pragma once

#include <cstddef>

#include "flash_msa/msa.h"

namespace flash_msa::cuda::warmup {

size_t forward_workspace_bytes(const ForwardParams& params);
size_t backward_workspace_bytes(const BackwardParams& params);

}  // namespace flash_msa::cuda::warmup
