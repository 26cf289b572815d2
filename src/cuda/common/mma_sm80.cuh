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
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
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
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
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

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(row_ptr)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
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
// them: lane quad c (lane % 4) of the row's thread writes its columns 8 t + 2 c + e (t < width
// / 8, e < 2) contiguously, so position c * width / 4 + 2 t + e holds column 8 t + 2 c + e.
// The passes that sum the partials read 8 positions at a time, which hold four column pairs.

// kWords consecutive 32-bit words (16-byte stores, or 8-byte ones for kWords = 2).
template <int kWords>
__device__ __forceinline__ void store_words(void* dst, const uint32_t (&words)[kWords]) {
  static_assert(kWords % 4 == 0 || kWords == 2, "16- or 8-byte stores");
  if constexpr (kWords == 2) {
    *static_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
#pragma unroll
    for (int x = 0; x < kWords / 4; ++x)
      static_cast<uint4*>(dst)[x] =
          make_uint4(words[4 * x], words[4 * x + 1], words[4 * x + 2], words[4 * x + 3]);
  }
}

// Positions 8 j .. 8 j + 7 of a fragment-order row of `width` columns (>= 32) hold columns
// col + 8 u, col + 8 u + 1 (u < 4) for col = fragment_column(j, width).
__device__ __forceinline__ int fragment_column(int j, int width) {
  const int quarter = width / 4;
  return 2 * (8 * j / quarter) + 8 * ((8 * j % quarter) / 2);
}

}  // namespace flash_msa::cuda
