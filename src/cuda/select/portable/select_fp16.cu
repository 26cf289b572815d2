// Select kernel for fp16 inputs, one instantiation per proxy head dim.
#include "cuda/select/portable/select_kernel.cuh"

FLASH_MSA_INSTANTIATE(FLASH_MSA_HEAD_DIMS, FLASH_MSA_SELECT_DIM, __half)
