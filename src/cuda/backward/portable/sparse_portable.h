// Launcher of the portable sparse backward (key-block-outer, see
// sparse_kernel.cuh), explicitly instantiated per dtype (sparse_bf16.cu, sparse_fp16.cu) for
// D in {32, 64, 128}; its teacher-only mode serves the forward's KL value (passes/teacher.cu).
// One launch covers one token chunk; edges and items are numbered as in the forward
// (forward/sparse_params.h). The Hopper kernel (backward/sm90/sparse_sm90.h) takes
// the same parameters and writes the same partials.
#pragma once

#include <cuda_runtime.h>

#include "cuda/backward/sparse_params.h"

namespace flash_msa::cuda::portable {

// kTeacherOnly: only P and the teacher rows (the KL value of the forward needs them).
template <class T, int kD, bool kTeacherOnly>
void launch_sparse_backward(const SparseBackwardParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::portable
