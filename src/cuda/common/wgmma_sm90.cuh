// Hopper (sm_90a) warpgroup tensor-core primitives: shared-memory matrix descriptors of
// 128-byte-swizzled tiles, wgmma.mma_async in the shapes the kernels use, and the fences
// around it (PTX ISA, "Asynchronous warpgroup level matrix multiply-accumulate").
//
// Tile layout ("SW128 panels"): a [rows, C] tile of 16-bit elements is stored as C / 64 panels of
// [rows, 64]; a panel row is 128 bytes, whose 16-byte chunk j sits at chunk j ^ (row % 8). Panels
// start 1024-byte aligned, so that the swizzle the hardware applies to address bits matches.
// Such a tile is a K-major operand when C is the reduction dimension (Q and K in S = Q K^T) and
// an MN-major one when the rows are (V in O = P V, rows = keys).
//
// Accumulator layout of m64nN (per warp w of the warpgroup, lane l): d[4 t + e] is row
// 16 w + l / 4 + 8 (e / 2), column 8 t + 2 (l % 4) + (e % 2), the mma.sync m16n8 layout per
// 8-column tile t; for 16-bit inputs the accumulator of columns 16 j .. 16 j + 15 packs into the
// A registers of k-step j of a following product (acc_to_a).
#pragma once

#include <cstdint>

#include "cuda/common/mma_sm80.cuh"

namespace flash_msa::cuda::sm90 {

// Byte offset of 16-byte chunk `chunk` (of C / 8) of row `row` in an SW128-panel tile of kRows
// rows.
template <int kRows>
__device__ __forceinline__ int sw128_offset(int row, int chunk) {
  return (chunk / 8) * kRows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

// The first 1024-byte aligned address at or after `raw` (dynamic shared memory), computed so
// that the compiler still knows the result is a shared-memory pointer.
__device__ __forceinline__ unsigned char* align_1024(unsigned char* raw) {
  return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}

// Rows [0, kRows) of an SW128-panel tile of kC columns from global memory: row_src(r, valid)
// returns the address of row r and sets `valid`; rows not valid are zero-filled (nothing is
// read, but the address must still be a global one). `thread` is this thread's rank among the
// kThreads copying threads, which copies 16-byte chunk thread % (kC / 8) of rows
// thread / (kC / 8) + j kThreads / (kC / 8). Asynchronous: the caller commits and waits.
template <int kRows, int kC, int kThreads, class RowSrc>
__device__ __forceinline__ void copy_rows_sw128(unsigned char* tile, const RowSrc& row_src,
                                                int thread) {
  constexpr int kChunks = kC / 8, kStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kStep % 8 == 0 && kRows % kStep == 0);
  const int chunk = thread % kChunks, row0 = thread / kChunks;
  // row0 + j kStep has the swizzle of row0: one address, stepped by kStep rows.
  const uint32_t dst = smem_addr(tile) + sw128_offset<kRows>(row0, chunk);
  // Every source address first, then the copies: the row lookups (shared loads) go out
  // together rather than each behind the copy before it.
  constexpr int kCopies = kRows / kStep;
  const void* src[kCopies];
  bool valid[kCopies];
#pragma unroll
  for (int j = 0; j < kCopies; ++j) src[j] = row_src(row0 + j * kStep, valid[j]) + chunk * 8;
#pragma unroll
  for (int j = 0; j < kCopies; ++j) cp_async_16(dst + j * kStep * 128, src[j], valid[j]);
}

// Descriptor of a 128B-swizzled operand at shared address `addr`: `sbo` bytes between 8-row groups
// of the strided dimension, `lbo` bytes between 64-element panels of an MN-major operand wider
// than one panel (unused for K-major operands).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

// The descriptor `desc` moved `bytes` (a multiple of 16) further into shared memory: the start
// address is the low field, and no shared address carries out of it.
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t bytes) {
  return (desc & ~uint64_t(0xFFFFFFFF)) | (uint32_t(desc) + (bytes >> 4));
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared-memory writes of the generic proxy (cp.async, st.shared) become visible to wgmma.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// This thread's warpgroup, broadcast from lane 0 so that the compiler knows it is the same in
// the whole warp and keeps what derives from it (shared addresses, descriptors) in uniform
// registers.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(~0u, threadIdx.x / 128, 0); }

// Sets to -inf this thread's entries of an m64nN accumulator (kN = N / 2 of them) whose columns
// lie outside lo[h] .. hi[h] for its row h, columns counted as 8 (j / 4) + j % 2 from the lane's
// first, 2 (lane % 4). Warp-uniform shortcut: nothing to do when every row of the warp sees all.
template <int kN>
__device__ __forceinline__ void mask_columns(float (&acc)[kN], const int (&lo)[2],
                                             const int (&hi)[2]) {
  constexpr int kLast = 8 * (kN / 4 - 1) + 1;
  if (__all_sync(~0u, lo[0] <= 0 && lo[1] <= 0 && hi[0] >= kLast && hi[1] >= kLast)) return;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const int h = (j % 4) / 2, c = 8 * (j / 4) + (j % 2);
    if (c < lo[h] || c > hi[h]) acc[j] = -INFINITY;
  }
}

// The named barrier ids of the Hopper kernels (hardware ids 1 to 15; 0 is __syncthreads), one
// per warpgroup wg of two: id + wg (the select kernel's four warpgroups take ids 1 to 4 for
// warpgroup_sync; it has no turns).
enum NamedBarrier : int {
  kWarpgroupBarrier = 1,  // the 128 threads of warpgroup wg (warpgroup_sync)
  kTurnBarrier = 3,       // the sparse forward's turns: warpgroup wg waits for its turn here
};

// Named barrier `id` over `threads` threads (a multiple of 32): wait at it, or arrive without
// waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Barrier of the 128 threads of warpgroup wg.
__device__ __forceinline__ void warpgroup_sync(int wg) {
  named_barrier_sync(kWarpgroupBarrier + wg, 128);
}
// Keeps the compiler from moving accesses of wgmma operand registers (accumulators, A fragments)
// across wgmma issue and wait.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int kM, int kN>
__device__ __forceinline__ void fence_operands(uint32_t (&d)[kM][kN]) {
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}

template <class T>
struct WgmmaType;
template <>
struct WgmmaType<__nv_bfloat16> {
  static constexpr bool kBf16 = true;
};
template <>
struct WgmmaType<__half> {
  static constexpr bool kBf16 = false;
};

// The asm statements, for the input type name TY ("bf16", "f16", "e4m3"); the accumulator
// registers of m64nN, N / 2 per thread, are operands %0 .. %(N / 2 - 1).
#define FLASH_MSA_WGMMA_D64                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "         \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "          \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "          \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FLASH_MSA_WGMMA_D32                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "         \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLASH_MSA_WGMMA_D32_OUT                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),              \
  "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),          \
  "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),                    \
  "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),                    \
  "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FLASH_MSA_WGMMA_D64_OUT                                                                    \
  FLASH_MSA_WGMMA_D32_OUT, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),        \
  "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),                    \
  "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),                    \
  "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),                    \
  "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),                    \
  "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FLASH_MSA_WGMMA_M64N128K16_SS(TY)                                                          \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " FLASH_MSA_WGMMA_D64             \
      ", %64, %65, p, 1, 1, %67, %68;\n}\n"                                                        \
      : FLASH_MSA_WGMMA_D64_OUT                                                                    \
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB))
#define FLASH_MSA_WGMMA_M64N128K16_RS(TY)                                                          \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " FLASH_MSA_WGMMA_D64             \
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                              \
      : FLASH_MSA_WGMMA_D64_OUT                                                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)))
#define FLASH_MSA_WGMMA_M64N128K32_RS(TY)                                                          \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k32.f32." TY "." TY " " FLASH_MSA_WGMMA_D64             \
      ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"                                                 \
      : FLASH_MSA_WGMMA_D64_OUT                                                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)))
#define FLASH_MSA_WGMMA_M64N64K16_RS_MN(TY)                                                        \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FLASH_MSA_WGMMA_D32              \
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                              \
      : FLASH_MSA_WGMMA_D32_OUT                                                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)))

#define FLASH_MSA_WGMMA_M64N64K16_SS(TY)                                                           \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FLASH_MSA_WGMMA_D32              \
      ", %32, %33, p, 1, 1, %35, %36;\n}\n"                                                        \
      : FLASH_MSA_WGMMA_D32_OUT                                                                    \
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB))

// d (64 x 128) (+)= A (64 x 16) * B (16 x 128), both in shared memory; kTransA / kTransB: the
// operand is MN-major (1) rather than K-major (0).
template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a,
                                                    uint64_t desc_b, bool accumulate) {
  if constexpr (WgmmaType<T>::kBf16)
    FLASH_MSA_WGMMA_M64N128K16_SS("bf16");
  else
    FLASH_MSA_WGMMA_M64N128K16_SS("f16");
}

// d (64 x 128) (+)= A (64 x 16, in registers as for mma.m16n8k16, per warp) * B (16 x 128,
// K-major, shared).
template <class T>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t desc_b, bool accumulate) {
  if constexpr (WgmmaType<T>::kBf16)
    FLASH_MSA_WGMMA_M64N128K16_RS("bf16");
  else
    FLASH_MSA_WGMMA_M64N128K16_RS("f16");
}

// d (64 x 128) (+)= A (64 x 32 FP8 E4M3, in registers as for mma.m16n8k32, per warp) *
// B (32 x 128 FP8 E4M3, K-major, shared): the byte layout of m64n128k16_rs with 16-bit
// inputs, each 16-bit element holding two FP8 ones.
__device__ __forceinline__ void wgmma_m64n128k32_rs_e4m3(float (&d)[64], const uint32_t (&a)[4],
                                                         uint64_t desc_b, bool accumulate) {
  FLASH_MSA_WGMMA_M64N128K32_RS("e4m3");
}

// d (64 x 64) (+)= A (64 x 16, in registers as for mma.m16n8k16, per warp) * B (16 x 64,
// MN-major, shared).
template <class T>
__device__ __forceinline__ void wgmma_m64n64k16_rs_mn(float (&d)[32], const uint32_t (&a)[4],
                                                      uint64_t desc_b, bool accumulate) {
  if constexpr (WgmmaType<T>::kBf16)
    FLASH_MSA_WGMMA_M64N64K16_RS_MN("bf16");
  else
    FLASH_MSA_WGMMA_M64N64K16_RS_MN("f16");
}

// d (64 x 64) (+)= A (64 x 16) * B (16 x 64), both in shared memory; kTransA / kTransB: the
// operand is MN-major (1) rather than K-major (0).
template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   bool accumulate) {
  if constexpr (WgmmaType<T>::kBf16)
    FLASH_MSA_WGMMA_M64N64K16_SS("bf16");
  else
    FLASH_MSA_WGMMA_M64N64K16_SS("f16");
}

#undef FLASH_MSA_WGMMA_M64N128K16_SS
#undef FLASH_MSA_WGMMA_M64N128K16_RS
#undef FLASH_MSA_WGMMA_M64N128K32_RS
#undef FLASH_MSA_WGMMA_M64N64K16_RS_MN
#undef FLASH_MSA_WGMMA_M64N64K16_SS
#undef FLASH_MSA_WGMMA_D64
#undef FLASH_MSA_WGMMA_D64_OUT
#undef FLASH_MSA_WGMMA_D32
#undef FLASH_MSA_WGMMA_D32_OUT

}  // namespace flash_msa::cuda::sm90
