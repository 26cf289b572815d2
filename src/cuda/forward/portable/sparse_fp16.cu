// Portable sparse forward for fp16 inputs, one instantiation per head dim.
#include "cuda/forward/portable/sparse_kernel.cuh"

FLASH_MSA_INSTANTIATE(FLASH_MSA_HEAD_DIMS, FLASH_MSA_SPARSE_FORWARD_DIM, __half)
