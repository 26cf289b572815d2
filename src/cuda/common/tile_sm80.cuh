// Warp-level tile algebra of the portable path on swizzled shared-memory tiles: fragment loads
// for the four operand orientations of mma.m16n8k16, warp GEMMs over a (kMT x 16) x (kNT x 8)
// warp tile, and cooperative row copies into tiles.
//
// A tile is [rows, kC] 16-bit elements, row-major, each row kC / 8 chunks of 16 bytes whose order
// is XOR-swizzled with the row (swizzle()), so that the 8 row addresses of one ldmatrix, all at
// the same logical chunk, fall in distinct banks.
//
// The warp GEMM acc[m][n] += sum_k A(m, k) B(k, n), by operand layout (GemmLayout):
//   nt: A stored [m][k], B stored [n][k]   (S = Q K^T)
//   nn: A stored [m][k], B stored [k][n]   (dQ = dS K)
//   tn: A stored [k][m], B stored [k][n]   (dV = P^T dO)
#pragma once

#include <cstdint>

#include "cuda/common/mma_sm80.cuh"

namespace flash_msa::cuda::portable {

template <int kRowChunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  constexpr int kMask = (kRowChunks < 8 ? kRowChunks : 8) - 1;
  return row * kRowChunks + (chunk ^ (row & kMask));
}

// Element offset of (row, column col) in a swizzled tile of kC columns; col % 8 == 0.
template <int kC>
__device__ __forceinline__ int tile_offset(int row, int col) {
  return swizzle<kC / 8>(row, col / 8) * 8;
}

// ---- fragment loads (lane = threadIdx.x % 32) ----

// A (16 x 16) at rows m0.., columns k0.. of a [m][k] tile.
template <int kC, class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int m0, int k0, int lane) {
  ldmatrix_x4(a, tile + tile_offset<kC>(m0 + lane % 16, k0 + (lane / 16) * 8));
}

// A (16 x 16) = the transpose of rows k0.., columns m0.. of a [k][m] tile.
template <int kC, class T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* tile, int m0, int k0,
                                             int lane) {
  const int j = lane / 8;
  ldmatrix_x4_trans(a, tile + tile_offset<kC>(k0 + lane % 8 + (j / 2) * 8, m0 + (j % 2) * 8));
}

// B of two n-tiles (n0.. n0+15) x (k0.. k0+15) from a [n][k] tile: b[0] for n0.., b[1] n0+8..
template <int kC, class T>
__device__ __forceinline__ void load_b2(uint32_t (&b)[2][2], const T* tile, int n0, int k0,
                                        int lane) {
  uint32_t r[4];
  ldmatrix_x4(r,
              tile + tile_offset<kC>(n0 + lane % 8 + (lane / 16) * 8, k0 + ((lane / 8) % 2) * 8));
  b[0][0] = r[0];
  b[0][1] = r[1];
  b[1][0] = r[2];
  b[1][1] = r[3];
}

// The same operands from a [k][n] tile.
template <int kC, class T>
__device__ __forceinline__ void load_b2_trans(uint32_t (&b)[2][2], const T* tile, int n0, int k0,
                                              int lane) {
  uint32_t r[4];
  ldmatrix_x4_trans(
      r, tile + tile_offset<kC>(k0 + lane % 8 + ((lane / 8) % 2) * 8, n0 + (lane / 16) * 8));
  b[0][0] = r[0];
  b[0][1] = r[1];
  b[1][0] = r[2];
  b[1][1] = r[3];
}

// ---- warp GEMMs; kK is the reduction length, kAC / kBC the column counts of the tiles ----

template <int kMT, int kNT>
__device__ __forceinline__ void zero(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
}

// Where the operands are stored (see the top of this file).
enum class GemmLayout { kNT, kNN, kTN };

template <class T, GemmLayout kLayout, int kMT, int kNT, int kK, int kAC, int kBC>
__device__ __forceinline__ void gemm(float (&acc)[kMT][kNT][4], const T* a_tile, int m0,
                                     const T* b_tile, int n0, int lane) {
  static_assert(kNT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int k = 0; k < kK; k += 16) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
      if constexpr (kLayout == GemmLayout::kTN)
        load_a_trans<kAC>(a[m], a_tile, m0 + 16 * m, k, lane);
      else
        load_a<kAC>(a[m], a_tile, m0 + 16 * m, k, lane);
    }
#pragma unroll
    for (int n = 0; n < kNT; n += 2) {
      uint32_t b[2][2];
      if constexpr (kLayout == GemmLayout::kNT)
        load_b2<kBC>(b, b_tile, n0 + 8 * n, k, lane);
      else
        load_b2_trans<kBC>(b, b_tile, n0 + 8 * n, k, lane);
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        mma_16x8x16<T>(acc[m][n], a[m], b[0]);
        mma_16x8x16<T>(acc[m][n + 1], a[m], b[1]);
      }
    }
  }
}

// The accumulator of n-tiles 2j and 2j+1 of one m-tile, rounded to T, is the A fragment of
// k-step j of a following product (P V with P in registers).
template <class T>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                         const float (&hi)[4]) {
  a[0] = Elem<T>::pack(lo[0], lo[1]);
  a[1] = Elem<T>::pack(lo[2], lo[3]);
  a[2] = Elem<T>::pack(hi[0], hi[1]);
  a[3] = Elem<T>::pack(hi[2], hi[3]);
}

// ---- cooperative copies (all threads of the CTA call them) ----

// Rows [0, kRows) of a [kRows, kC] tile from global memory: row r from row_ptr(r), or zeros
// where row_ptr(r) is null (nothing is read; `any_global` only stands in as the source
// address). Asynchronous: the caller commits and waits.
template <int kRows, int kC, int kThreads, class T, class RowPtr>
__device__ __forceinline__ void copy_rows_async(T* tile, const RowPtr& row_ptr,
                                                const T* any_global) {
  constexpr int kChunks = kC / 8;
#pragma unroll 4
  for (int x = threadIdx.x; x < kRows * kChunks; x += kThreads) {
    const int row = x / kChunks, chunk = x % kChunks;
    const T* src = row_ptr(row);
    cp_async_16(tile + swizzle<kChunks>(row, chunk) * 8, src ? src + chunk * 8 : any_global,
                src != nullptr);
  }
}

}  // namespace flash_msa::cuda::portable
