// Warmup forward for bf16 inputs, one instantiation per supported (D, Dp) pair.
#include "cuda/warmup/portable/forward_kernel.cuh"

FLASH_MSA_INSTANTIATE(FLASH_MSA_ATTENTION_DIMS, FLASH_MSA_WARMUP_FORWARD_DIM, __nv_bfloat16)
