// Warp-level tensor-core primitives of the portable path (sm_80 and newer): mma.sync
// m16n8k16 with fp32 accumulators, ldmatrix, cp.async, and 16-bit element traits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flash_msa::cuda {

// Element traits: the 16-bit storage type and its packed-pair conversions.
template <class T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t bits) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&bits));
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

template <>
struct Elem<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t bits) {
    return __half22float2(*reinterpret_cast<__half2*>(&bits));
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
};

// D = A * B + D for a 16x8x16 tile. A: 4 regs (row-major 16x16), B: 2 regs (16x8, "col"),
// D: 4 fp32 regs. Fragment layouts are the PTX ISA's for mma.m16n8k16.
template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                    const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 2^x by the special-function unit alone (ex2.approx.ftz: relative error about 2^-22, results
// below 2^-126 flushed to zero), without exp2f's rescaling around subnormal results; x = -inf
// gives 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x and log2(x) likewise (rcp.approx.ftz, lg2.approx.ftz), for normal x such as a
// softmax row sum, which is at least 1.
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

// 16-byte global->shared copy to the shared-window address `smem_dst`; `valid == false`
// zero-fills the destination (no global read).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  cp_async_16(smem_addr(smem_dst), gmem_src, valid);
}

// 4-byte global->shared copy (through L1); `valid == false` zero-fills the destination.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem_dst)),
               "l"(gmem_src), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- partial rows in fragment order ----
// The per-edge partial rows (forward out, dQ, dQp) are stored as the accumulator fragments hold
// them: the thread of lane quad c (lane % 4) holds columns 8 t + 2 c + e (column tile t, e < 2),
// stored at position 8 (4 (t / 4) + c) + 2 (t % 4) + e. Each thread writes four column tiles
// (8 elements) contiguously, and the four lanes of a quad fill 32 contiguous elements, so a
// warp's store covers whole 32-byte sectors. The passes that sum the partials read octets.

// Stores this thread's column tiles t0 .. t0 + kTiles - 1 of a fragment-order row starting at
// `row`, kWordsPerTile 32-bit words per tile (1: a pair of 16-bit elements, 2: of floats),
// `quad` = lane % 4; t0 a multiple of 4 (of 2 where kTiles = 2).
template <int kTiles, int kWordsPerTile>
__device__ __forceinline__ void store_fragment_row(
    void* row, int quad, int t0, const uint32_t (&words)[kTiles * kWordsPerTile]) {
  static_assert(kTiles % 4 == 0 || kTiles == 2, "whole quads of tiles, or one pair");
  constexpr int kElemBytes = 2 * kWordsPerTile;
  unsigned char* const base = static_cast<unsigned char*>(row);
  if constexpr (kTiles == 2) {
    unsigned char* dst = base + (8 * (4 * (t0 / 4) + quad) + 2 * (t0 % 4)) * kElemBytes;
    if constexpr (kWordsPerTile == 1)
      *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  } else {
#pragma unroll
    for (int g = 0; g < kTiles / 4; ++g) {
      uint4* dst = reinterpret_cast<uint4*>(base + 8 * (t0 + 4 * g + quad) * kElemBytes);
#pragma unroll
      for (int x = 0; x < kWordsPerTile; ++x) {
        const int w = 4 * kWordsPerTile * g + 4 * x;
        dst[x] = make_uint4(words[w], words[w + 1], words[w + 2], words[w + 3]);
      }
    }
  }
}

// Positions 8 j .. 8 j + 7 of a fragment-order row hold columns col + 8 u, col + 8 u + 1
// (u < 4) for col = fragment_column(j).
__device__ __forceinline__ int fragment_column(int j) { return 32 * (j / 4) + 2 * (j % 4); }

}  // namespace flash_msa::cuda
