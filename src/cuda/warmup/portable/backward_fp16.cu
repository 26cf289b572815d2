// Warmup backward for fp16 inputs, one instantiation per supported (D, Dp) pair.
#include "cuda/warmup/portable/backward_launch.cuh"

FLASH_MSA_INSTANTIATE(FLASH_MSA_ATTENTION_DIMS, FLASH_MSA_WARMUP_BACKWARD_DIM, __half)
