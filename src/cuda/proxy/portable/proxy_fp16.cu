// Proxy-branch kernel for fp16 inputs, one instantiation per proxy head dim and mode.
#include "cuda/proxy/portable/proxy_kernel.cuh"

FLASH_MSA_INSTANTIATE(FLASH_MSA_HEAD_DIMS, FLASH_MSA_PROXY_DIM, __half)
