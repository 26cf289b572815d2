// CPU backend: the reference implementation of every operation (fp32 accumulation, std::thread
// workers, memory linear in S in sparse mode). All pointers are host memory.
//
// float64 (DType::kFloat64) runs on this backend only, computed in double precision throughout
// (the other dtypes keep fp32 arithmetic), so that gradients can be checked against finite
// differences at double precision. Its statistics are double as well (stats_dtype, msa.h): with
// a float64 problem, lse, lse_proxy, kl and kl_grad point to double storage of the documented
// shapes. The scales stay Problem's float values.
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
// dk, dv, dkp sums are bitwise reproducible for a fixed count. FLASH_MSA_NUM_THREADS is read at
// each operation that uses the default; a value that is not a whole number in [1, 65536] (say
// "abc" or "0") makes that operation throw flash_msa::Error naming the variable and the value.
// An empty value counts as unset.
void set_num_threads(int threads);
int num_threads();

}  // namespace flash_msa::cpu
