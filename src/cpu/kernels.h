// Inner loops of the CPU backend, written so that the compiler vectorises them over channels
// (`omp simd` loops, built with -fopenmp-simd: no OpenMP runtime), and the attended key set of one
// query as ranges of contiguous keys. The loops are templates on the compute type T (float, or
// double for float64 tensors).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/tensor.h"
#include "flash_msa/msa.h"

namespace flash_msa::cpu {

// Keys per tile in the per-query loops: a tile of key rows stays in L1 while every head of the
// proxy group reads it.
inline constexpr int64_t kKeyTile = 32;

// Consecutive query rows per thread chunk: neighbours mostly select the same blocks, so their
// keys are still in cache.
inline constexpr int64_t kRowChunk = 16;

// The four consecutive rows of `dim` values from `first`.
template <class T>
std::array<const T*, 4> four_rows(const T* first, int64_t dim) {
  return {first, first + dim, first + 2 * dim, first + 3 * dim};
}

template <class T>
T dot(const T* __restrict a, const T* __restrict b, int64_t dim) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < dim; ++c) s += a[c] * b[c];
  return s;
}

// out_r[x] = <row_r, keys[x]> for two rows (r = 0, 1), or one when row1 is null, and n
// contiguous key rows of `dim` values. A 2 x 4 tile of dot products per pass: six loads feed
// eight multiply-adds.
template <class T>
void dots2(const T* __restrict row0, const T* __restrict row1, const T* __restrict keys, int64_t n,
           int64_t dim, T* __restrict out0, T* __restrict out1) {
  int64_t x = 0;
  for (; x + 4 <= n; x += 4) {
    const auto [k0, k1, k2, k3] = four_rows(keys + x * dim, dim);
    T a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
    if (row1 == nullptr) {
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t c = 0; c < dim; ++c) {
        a0 += row0[c] * k0[c];
        a1 += row0[c] * k1[c];
        a2 += row0[c] * k2[c];
        a3 += row0[c] * k3[c];
      }
    } else {
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
      for (int64_t c = 0; c < dim; ++c) {
        a0 += row0[c] * k0[c];
        a1 += row0[c] * k1[c];
        a2 += row0[c] * k2[c];
        a3 += row0[c] * k3[c];
        b0 += row1[c] * k0[c];
        b1 += row1[c] * k1[c];
        b2 += row1[c] * k2[c];
        b3 += row1[c] * k3[c];
      }
      out1[x] = b0, out1[x + 1] = b1, out1[x + 2] = b2, out1[x + 3] = b3;
    }
    out0[x] = a0, out0[x + 1] = a1, out0[x + 2] = a2, out0[x + 3] = a3;
  }
  for (; x < n; ++x) {
    const T* k0 = keys + x * dim;
    out0[x] = dot(row0, k0, dim);
    if (row1 != nullptr) out1[x] = dot(row1, k0, dim);
  }
}

// out[x] = <row, keys[x]> for n contiguous key rows of `dim` values.
template <class T>
void dots(const T* __restrict row, const T* __restrict keys, int64_t n, int64_t dim,
          T* __restrict out) {
  dots2<T>(row, nullptr, keys, n, dim, out, nullptr);
}

// acc_a[c] += sum_r coef_a[r * coef_stride] * rows[r * dim + c] for two accumulators (a = 0, 1)
// sharing the rows: four rows per pass, so eight loads and stores feed eight multiply-adds.
// acc1 may be null (a lone accumulator).
template <class T>
void axpy2(T* __restrict acc0, T* __restrict acc1, const T* coef0, const T* coef1,
           int64_t coef_stride, const T* __restrict rows, int64_t n, int64_t dim) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const auto [r0, r1, r2, r3] = four_rows(rows + r * dim, dim);
    const T a0 = coef0[r * coef_stride], a1 = coef0[(r + 1) * coef_stride];
    const T a2 = coef0[(r + 2) * coef_stride], a3 = coef0[(r + 3) * coef_stride];
    if (acc1 == nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c)
        acc0[c] += a0 * r0[c] + a1 * r1[c] + a2 * r2[c] + a3 * r3[c];
      continue;
    }
    const T b0 = coef1[r * coef_stride], b1 = coef1[(r + 1) * coef_stride];
    const T b2 = coef1[(r + 2) * coef_stride], b3 = coef1[(r + 3) * coef_stride];
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) {
      acc0[c] += a0 * r0[c] + a1 * r1[c] + a2 * r2[c] + a3 * r3[c];
      acc1[c] += b0 * r0[c] + b1 * r1[c] + b2 * r2[c] + b3 * r3[c];
    }
  }
  for (; r < n; ++r) {
    const T* r0 = rows + r * dim;
    const T a0 = coef0[r * coef_stride];
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) acc0[c] += a0 * r0[c];
    if (acc1 == nullptr) continue;
    const T b0 = coef1[r * coef_stride];
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) acc1[c] += b0 * r0[c];
  }
}

// acc[c] += sum_r coef[r * coef_stride] * rows[r * dim + c].
template <class T>
void axpy(T* acc, const T* coef, int64_t coef_stride, const T* rows, int64_t n, int64_t dim) {
  axpy2<T>(acc, nullptr, coef, nullptr, coef_stride, rows, n, dim);
}

// Keys [begin, end) of one batch row.
struct KeyRange {
  int64_t begin = 0, end = 0;
};

// The attended keys T(p, i) of query i whose document starts at `start`: the visible keys of the
// selected blocks (indices row of K entries, -1 padded) or, in warmup (row null), all visible
// keys. Writes the ranges to `out` (room for K) and returns how many.
inline int64_t attended_ranges(const int32_t* row, int64_t top_k, int64_t start, int64_t i,
                               KeyRange* out) {
  if (row == nullptr) {
    out[0] = {start, i + 1};
    return 1;
  }
  int64_t n = 0;
  for (int64_t x = 0; x < top_k && row[x] >= 0; ++x)
    out[n++] = {std::max<int64_t>(row[x] * kBlockSize, start),
                std::min<int64_t>((row[x] + 1) * kBlockSize, i + 1)};
  return n;
}

inline int64_t key_count(const KeyRange* ranges, int64_t n) {
  int64_t count = 0;
  for (int64_t r = 0; r < n; ++r) count += ranges[r].end - ranges[r].begin;
  return count;
}

// Calls f(first key, key count, position of the first key in the attended list) for each tile of
// at most kKeyTile contiguous attended keys.
template <class F>
void for_each_key_tile(const KeyRange* ranges, int64_t n, F&& f) {
  int64_t x = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = ranges[r].begin; j < ranges[r].end; j += kKeyTile) {
      const int64_t len = std::min(kKeyTile, ranges[r].end - j);
      f(j, len, x);
      x += len;
    }
}

// In place: a[0..n) -> softmax(a); returns log sum exp(a).
template <class T>
T softmax(T* a, int64_t n) {
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t x = 0; x < n; ++x) mx = std::max(mx, a[x]);
  T sum = 0;
  for (int64_t x = 0; x < n; ++x) {
    a[x] = std::exp(a[x] - mx);
    sum += a[x];
  }
  const T inv = T(1) / sum;
#pragma omp simd
  for (int64_t x = 0; x < n; ++x) a[x] *= inv;
  return mx + std::log(sum);
}

}  // namespace flash_msa::cpu
