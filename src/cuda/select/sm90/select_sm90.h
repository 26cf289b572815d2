// Launcher of the Hopper proxy-select kernel (select_kernel.cuh), instantiated per dtype for
// Dp = 64 and 128 and for FP8 E4M3 at Dp = 128 (select.cu). Takes the portable kernel's
// parameters and writes the same indices; the host entry launches it where select_kernels()
// says kHopper (cuda.h). The FP8 select (SelectPrecision::kFloat8E4M3) first quantises q_proxy
// and k_proxy (quantize.cuh) into the workspace. Where the query tiles give too few CTAs to
// fill the GPU (short sequences), each CTA's walk over the key blocks is cut into parts that
// run as CTAs of their own; the CTA of the part that finishes last merges the others' top-K
// lists into its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/select/select_params.h"

namespace flash_msa::cuda::sm90 {

// The parts of a select whose key walks are cut: per query row (the rows of the indices, B *
// Hp * Sq) and part, the {score bits, block} entries that the part's top-K list kept and their
// count, and per walk the parts done. count = 1: the walks are whole.
struct SelectParts {
  int count = 1;
  int2* entries = nullptr;    // [B * Hp * Sq, count, K]
  int32_t* fills = nullptr;   // [B * Hp * Sq, count]
  uint32_t* done = nullptr;   // [walks]: the select's grid over count; zeroed by the launch
};

inline constexpr int kMaxSelectParts = 4;
// Parts per key walk for `params` on the Hopper kernel: enough CTAs for three waves of a
// 132-SM GPU (H100, H200) where the query tiles give fewer, each part at least 8 blocks of the
// longest walk, at most kMaxSelectParts; 1 otherwise. A function of the shape alone, so the
// workspace does not depend on the GPU.
int select_parts(const portable::SelectKernelParams& params);
// The walks of the Hopper kernel for `params`: one per two query tiles, batch row and proxy head.
int64_t select_walks(const portable::SelectKernelParams& params);

// parts.count > 1: each part writes parts.entries and parts.fills, and the last part of a walk
// to finish merges them and writes params.indices.
template <class T, int kDp>
void launch_select(const portable::SelectKernelParams& params, const SelectParts& parts,
                   cudaStream_t stream);

inline constexpr int kSelectFp8Dp = 128;  // the one proxy head dim of the FP8 select

// What the kernel takes; the host's choice (host/variants.cu) reads it.
inline constexpr char kSelectTakes[] = "Dp = 64 or 128";
inline bool select_takes(const Problem& pr) {
  return pr.proxy_head_dim == 64 || pr.proxy_head_dim == 128;
}

struct QuantizeParams {
  ConstView in;        // [B, H, tokens, 128] strided, 8-byte aligned rows
  uint8_t* out;        // [B, H, padded, 128] contiguous E4M3; rows past `tokens` zero
  float* scales;       // [B, H, padded] contiguous, 1 past `tokens`; null: not written
  int64_t rows;        // B * H * padded
  int heads;           // H
  int tokens, padded;  // rows of `in` per (b, h); rows of `out` per (b, h), >= tokens
};

template <class T>
void launch_quantize(const QuantizeParams& params, cudaStream_t stream);

}  // namespace flash_msa::cuda::sm90
