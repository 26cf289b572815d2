// Host tensor plumbing for the CPU backend: dtype conversion (round to nearest even), copies of
// strided views in the compute type, row loads and stores.
//
// The compute type T is float for float32, bfloat16 and float16 tensors and double for float64
// tensors (with_compute_type below): every operation is a template on T, so the float path is
// the fp32 arithmetic of the reference and float64 inputs are computed in double throughout.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/parallel.h"
#include "flash_msa/msa.h"

namespace flash_msa::cpu {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // keep it a quiet NaN
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa units of 2^-24, exact in fp32
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exponent == 31) return bits_to_float(sign | 0x7f800000 | (mantissa << 13));
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffff;
  if (a > 0x7f800000) return sign | 0x7e00;
  if (a >= 0x477ff000) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (a < 0x38800000) {  // below 2^-14: fp16 subnormal, 2^24 * |f| < 1024 is exact
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.f));
  }
  const uint32_t r = a - (112u << 23);  // rebias the exponent from 127 to 15
  return sign | static_cast<uint16_t>((r + 0xfff + ((r >> 13) & 1)) >> 13);
}

template <class T>
int64_t offset(const View4<T>& v, int64_t b, int64_t h, int64_t s) {
  return b * v.stride_b + h * v.stride_h + s * v.stride_s;
}

// Calls f(T{}) with the compute type of `dtype`: double for float64, float otherwise.
template <class F>
decltype(auto) with_compute_type(DType dtype, F&& f) {
  if (dtype == DType::kFloat64) return f(double{});
  return f(float{});
}

// The statistics (lse, lse_proxy, kl, kl_grad) are held in the compute type, which is the
// stats dtype of the problem (stats_dtype, msa.h).
template <class T>
T* stats_ptr(void* p) {
  return static_cast<T*>(p);
}
template <class T>
const T* stats_ptr(const void* p) {
  return static_cast<const T*>(p);
}

// dst[0..n) = the n elements at `src` (element offset `at`), as T. Only float64 tensors are read
// into double rows; float rows take the other dtypes.
template <class T>
void load_row(DType dtype, const void* src, int64_t at, int64_t n, T* dst) {
  if constexpr (std::is_same_v<T, double>) {
    std::memcpy(dst, static_cast<const double*>(src) + at, static_cast<size_t>(n) * sizeof(double));
  } else {
    if (dtype == DType::kFloat32) {
      std::memcpy(dst, static_cast<const float*>(src) + at, static_cast<size_t>(n) * sizeof(float));
      return;
    }
    const uint16_t* h = static_cast<const uint16_t*>(src) + at;
    if (dtype == DType::kBFloat16) {
      for (int64_t c = 0; c < n; ++c) dst[c] = bf16_to_float(h[c]);
    } else {
      for (int64_t c = 0; c < n; ++c) dst[c] = fp16_to_float(h[c]);
    }
  }
}

// Scales and stores n values of the compute type to `dst` (element offset `at`) in `dtype`.
template <class T>
void store_row(DType dtype, void* dst, int64_t at, const T* src, int64_t n,
               std::type_identity_t<T> scale = 1) {
  if constexpr (std::is_same_v<T, double>) {
    double* f = static_cast<double*>(dst) + at;
    for (int64_t c = 0; c < n; ++c) f[c] = src[c] * scale;
  } else {
    if (dtype == DType::kFloat32) {
      float* f = static_cast<float*>(dst) + at;
      for (int64_t c = 0; c < n; ++c) f[c] = src[c] * scale;
      return;
    }
    uint16_t* h = static_cast<uint16_t*>(dst) + at;
    if (dtype == DType::kBFloat16) {
      for (int64_t c = 0; c < n; ++c) h[c] = float_to_bf16(src[c] * scale);
    } else {
      for (int64_t c = 0; c < n; ++c) h[c] = float_to_fp16(src[c] * scale);
    }
  }
}

// A contiguous copy [B, heads, S, C] in the compute type T of a strided view, for tensors read
// many times.
template <class T>
struct Packed {
  static constexpr int64_t kLoadChunk = 256;  // rows per thread chunk of the copy

  std::vector<T> data;
  int64_t heads = 0, seqlen = 0, channels = 0;

  Packed(DType dtype, const ConstView& view, int64_t batch, int64_t heads_, int64_t seqlen_,
         int64_t channels_)
      : data(static_cast<size_t>(batch * heads_ * seqlen_ * channels_)),
        heads(heads_),
        seqlen(seqlen_),
        channels(channels_) {
    const int64_t rows = batch * heads * seqlen;
    parallel_static(rows, kLoadChunk, [&](int, StaticRows& it) {
      for (int64_t r; it.next(r);) {
        const int64_t b = r / (heads * seqlen), h = r / seqlen % heads, s = r % seqlen;
        load_row(dtype, view.data, offset(view, b, h, s), channels,
                 &data[static_cast<size_t>(r * channels)]);
      }
    });
  }

  const T* row(int64_t b, int64_t h, int64_t s) const {
    return &data[static_cast<size_t>(((b * heads + h) * seqlen + s) * channels)];
  }
};

}  // namespace flash_msa::cpu
