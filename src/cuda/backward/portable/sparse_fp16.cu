// Portable sparse backward for fp16 inputs, one instantiation per head dim (gradient
// mode; passes/teacher.cu instantiates the teacher mode).
#include "cuda/backward/portable/sparse_kernel.cuh"

FLASH_MSA_INSTANTIATE(FLASH_MSA_HEAD_DIMS, FLASH_MSA_SPARSE_BACKWARD_DIM, __half)
