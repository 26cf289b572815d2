// FP8 E4M3 (the "fn" variant: bias 7, no infinities, 0x7f the NaN, largest finite 448) and the
// per-token quantisation of the FP8 proxy select (SelectPrecision::kFloat8E4M3, msa.h), on the
// host. The CUDA quantisation (select/sm90/quantize.cuh) takes the same row scale
// (e4m3_scale), rounds with the hardware conversion (cvt.rn.satfinite.e4m3x2.f32) and must agree
// with this bit for bit (tests/cuda/select_test.cu).
#pragma once

#include <cmath>
#include <cstdint>

namespace flash_msa {

inline constexpr float kE4M3Max = 448.f;

// Round to nearest even, saturated to +-448 (infinities too); NaN to the NaN 0x7f.
inline uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a > kE4M3Max) return sign | 0x7e;  // saturate, infinities too
  if (a >= 0.015625f) {                  // 2^-6 and up: normal, 3 mantissa bits
    int e;
    const float m = std::frexp(a, &e);                   // a = m 2^e, m in [0.5, 1)
    int q = static_cast<int>(std::nearbyint(m * 16.f));  // 8 .. 16: 1.mmm in units of 1/8
    if (q == 16) q = 8, ++e;
    const int biased = e - 1 + 7;
    if (biased == 15 && q > 14) return sign | 0x7e;  // rounds above 448: saturate
    return sign | static_cast<uint8_t>((biased << 3) | (q - 8));
  }
  // Subnormal: units of 2^-9; 8 units round up into the smallest normal, 0x08.
  return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
}

inline float e4m3_to_float(uint8_t x) {
  const bool negative = x & 0x80;
  const int biased = (x >> 3) & 15, mantissa = x & 7;
  float v;
  if (biased == 15 && mantissa == 7) {
    v = NAN;
  } else if (biased == 0) {
    v = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    v = std::ldexp(static_cast<float>(8 + mantissa), biased - 10);
  }
  return negative ? -v : v;
}

// The scale of a token row whose largest magnitude is `amax`: amax / 448, or 1 for a row of
// zeros. constexpr, so that the CUDA quantisation calls it too (--expt-relaxed-constexpr; the
// division rounds to nearest on both sides).
constexpr float e4m3_scale(float amax) { return amax > 0.f ? amax / kE4M3Max : 1.f; }

}  // namespace flash_msa
