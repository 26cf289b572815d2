// The instantiation set of the kernels: the head dims the CUDA backend ships, for the explicit
// instantiations at the end of each kernel header (one .cu file per dtype, so that builds run in
// parallel). host/dispatch.h maps a call's (dtype, D, Dp) onto this set and host/limits.h
// refuses anything outside it.
#pragma once

// F(T, d) for each head dim D of the sparse kernels and each proxy head dim Dp of select and the
// proxy kernel.
#define FLASH_MSA_HEAD_DIMS(F, T) F(T, 32) F(T, 64) F(T, 128)
// F(T, D, Dp) for each (D, Dp) pair of the main-attention entries.
#define FLASH_MSA_ATTENTION_DIMS(F, T) \
  F(T, 32, 32) F(T, 64, 32) F(T, 64, 64) F(T, 128, 64) F(T, 128, 128)

// In the portable kernels' namespace: F(T, dims...) for each entry of DIMS (one of the lists
// above); each kernel header defines its F.
#define FLASH_MSA_INSTANTIATE(DIMS, F, T) \
  namespace flash_msa::cuda::portable {   \
  DIMS(F, T)                              \
  }
