// Host-side values shared by the tests and the CLI (tools/msa_step.cc): conversions between float
// and the 16-bit dtypes, element access in a dtype, a counter-based random generator, and a
// bitwise digest. Header-only, standard library and the public API only (no GoogleTest), so the
// CLI includes it as it is.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "flash_msa/msa.h"

namespace flash_msa::host {

// ---- bf16 / fp16 conversion (round to nearest even) ----

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x0040);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  float v;
  if (exponent == 0) {
    v = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    v = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  return (h & 0x8000) ? -v : v;
}

inline uint16_t float_to_fp16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | 0x7e00;
  const float a = std::fabs(f);
  if (a >= 65520.f) return sign | 0x7c00;
  if (a < 6.103515625e-05f) {  // subnormal range: units of 2^-24 (1024 becomes the smallest normal)
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24)));
  }
  int e;
  std::frexp(a, &e);                                                       // a in [2^(e-1), 2^e)
  int mantissa = static_cast<int>(std::nearbyint(std::ldexp(a, 11 - e)));  // [1024, 2048]
  int exponent = e - 1;
  if (mantissa == 2048) {
    mantissa = 1024;
    ++exponent;
  }
  if (exponent > 15) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((exponent + 15) << 10) | (mantissa - 1024));
}

// Rounds a float to the nearest value representable in `dtype` (float32 and float64 keep it).
inline float round_to(DType dtype, float f) {
  switch (dtype) {
    case DType::kFloat16:
      return fp16_to_float(float_to_fp16(f));
    case DType::kBFloat16:
      return bf16_to_float(float_to_bf16(f));
    default:
      return f;
  }
}

// ---- elements of a buffer in a dtype ----

inline size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return 8;
    case DType::kFloat32:
      return 4;
    default:
      return 2;
  }
}

// Element i of a buffer of `dtype` values, as a float.
inline float load_element(DType dtype, const void* data, int64_t i) {
  const unsigned char* p =
      static_cast<const unsigned char*>(data) + static_cast<size_t>(i) * element_size(dtype);
  switch (dtype) {
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, p, sizeof d);
      return static_cast<float>(d);
    }
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, sizeof f);
      return f;
    }
    default: {
      uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return dtype == DType::kFloat16 ? fp16_to_float(h) : bf16_to_float(h);
    }
  }
}

// Stores f, rounded to nearest even, as element i of a buffer of `dtype` values.
inline void store_element(DType dtype, void* data, int64_t i, float f) {
  unsigned char* p =
      static_cast<unsigned char*>(data) + static_cast<size_t>(i) * element_size(dtype);
  switch (dtype) {
    case DType::kFloat64: {
      const double d = f;
      std::memcpy(p, &d, sizeof d);
      return;
    }
    case DType::kFloat32:
      std::memcpy(p, &f, sizeof f);
      return;
    default: {
      const uint16_t h = dtype == DType::kFloat16 ? float_to_fp16(f) : float_to_bf16(f);
      std::memcpy(p, &h, sizeof h);
    }
  }
}

// ---- counter-based random values ----

// Value number `i` of stream `stream` under `seed`: uniform on (-sqrt(3), sqrt(3)) (mean 0,
// variance 1) with |x| >= 1e-3, never exactly zero. A pure function of its arguments (a splitmix64
// hash of the counter), so a buffer can be filled in parallel, in any order, reproducibly.
inline float counter_uniform(uint64_t seed, uint64_t stream, uint64_t i) {
  uint64_t z =
      seed * 0x9e3779b97f4a7c15ull + stream * 0xbf58476d1ce4e5b9ull + i * 0x94d049bb133111ebull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const double u = (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
  const double x = (2.0 * u - 1.0) * 1.7320508075688772;
  return static_cast<float>(std::fabs(x) < 1e-3 ? (x < 0 ? -1e-3 : 1e-3) : x);
}

// ---- bitwise digest ----

inline constexpr uint64_t kFnv1a64Offset = 0xcbf29ce484222325ull;
inline constexpr uint64_t kFnv1a64Prime = 0x100000001b3ull;

// 64-bit FNV-1a of `bytes` bytes (pass the previous result as `h` to continue a digest). Equal
// digests of two buffers mean, short of a 2^-64 accident, bitwise-equal buffers.
inline uint64_t fnv1a64(const void* data, size_t bytes, uint64_t h = kFnv1a64Offset) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t x = 0; x < bytes; ++x) {
    h ^= p[x];
    h *= kFnv1a64Prime;
  }
  return h;
}

}  // namespace flash_msa::host
