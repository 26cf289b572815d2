// CPU backend: the reference implementation of every operation (fp32 accumulation, std::thread
// workers, memory linear in S in sparse mode). All pointers are host memory.
#pragma once

#include "flash_msa/msa.h"

namespace flash_msa::cpu {

void select(const SelectParams& params);
void sparse_forward(const ForwardParams& params);
void sparse_backward(const BackwardParams& params);
void warmup_forward(const ForwardParams& params);
void warmup_backward(const BackwardParams& params);

// Worker threads of every CPU operation: `threads` > 0 sets the count, 0 restores the default
// (the FLASH_MSA_NUM_THREADS environment variable, else one per hardware thread). The backward's
// dk, dv, dkp sums are bitwise reproducible for a fixed count.
void set_num_threads(int threads);
int num_threads();

}  // namespace flash_msa::cpu
