// The teacher rows of the forward's KL value: the portable sparse backward kernel in teacher
// mode (P and its mean over the group's heads, no gradients), for every dtype and head dim.
#include "cuda/backward/portable/sparse_kernel.cuh"
#include "cuda/common/instantiate.h"
#include "cuda/passes/passes.h"

namespace flash_msa::cuda::passes {

template <class T, int kD>
void launch_teacher(const portable::SparseBackwardParams& params, cudaStream_t stream) {
  portable::launch_sparse_backward<T, kD, true>(params, stream);
}

#define FLASH_MSA_PASS_DIM(T, D) \
  template void launch_teacher<T, D>(const portable::SparseBackwardParams&, cudaStream_t);
FLASH_MSA_HEAD_DIMS(FLASH_MSA_PASS_DIM, __nv_bfloat16)
FLASH_MSA_HEAD_DIMS(FLASH_MSA_PASS_DIM, __half)

}  // namespace flash_msa::cuda::passes
