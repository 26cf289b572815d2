// CPU backend: the reference implementation of every operation (fp32 accumulation,
// OpenMP threads, memory linear in S in sparse mode). All pointers are host memory.
#pragma once

#include "flash_msa/msa.h"

namespace flash_msa::cpu {

void select(const SelectParams& params);
void sparse_forward(const ForwardParams& params);
void sparse_backward(const BackwardParams& params);
void warmup_forward(const ForwardParams& params);
void warmup_backward(const BackwardParams& params);

}  // namespace flash_msa::cpu
