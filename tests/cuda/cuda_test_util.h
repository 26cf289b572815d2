// Helpers shared by the CUDA tests: device allocations, 16-bit packed (optionally strided and
// poisoned) host copies of test tensors, the comparisons against the CPU backend, and fixtures
// that skip when no CUDA device is present.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "common/problem.h"
#include "flash_msa/cuda.h"

namespace flash_msa::test {

// Owns one device allocation, optionally filled from host memory. With kExpectSuccess the
// allocation and upload are test expectations; without, a failed allocation leaves get() null.
template <bool kExpectSuccess>
class DeviceAllocation {
 public:
  explicit DeviceAllocation(size_t bytes) : bytes_(bytes) {
    if (bytes_ == 0) return;
    const cudaError_t err = cudaMalloc(&ptr_, bytes_);
    if constexpr (kExpectSuccess) {
      EXPECT_EQ(err, cudaSuccess);
    } else if (err != cudaSuccess) {
      ptr_ = nullptr;
    }
  }
  DeviceAllocation(const void* host, size_t bytes) : DeviceAllocation(bytes) {
    if (!ptr_) return;
    const cudaError_t err = cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);
    if constexpr (kExpectSuccess) EXPECT_EQ(err, cudaSuccess);
  }
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation() { cudaFree(ptr_); }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};
using DeviceMemory = DeviceAllocation<false>;
using DeviceBuffer = DeviceAllocation<true>;

// A logical [n0, n1, n2, n3] tensor in a 16-bit dtype: contiguous, or token-major [n0, n2, n1,
// n3] with 16-byte multiples of padding (the CUDA backend needs 16-byte aligned rows).
struct Packed {
  std::vector<uint16_t> bits;
  int64_t n0 = 0, n1 = 0, n2 = 0, n3 = 0;
  int64_t stride_b = 0, stride_h = 0, stride_s = 0;

  int64_t offset(int64_t b, int64_t h, int64_t s, int64_t c) const {
    return b * stride_b + h * stride_h + s * stride_s + c;
  }
};

// The strides of `layout`, every element (view and padding) set to the 0xFFFF poison.
inline Packed layout_of(int64_t n0, int64_t n1, int64_t n2, int64_t n3, Layout layout) {
  Packed p{{}, n0, n1, n2, n3};
  if (layout == Layout::kContiguous) {
    p.stride_s = n3;
    p.stride_h = n2 * n3;
    p.stride_b = n1 * p.stride_h;
  } else {
    p.stride_h = n3 + 8;
    p.stride_s = n1 * p.stride_h + 16;
    p.stride_b = n2 * p.stride_s + 8;
  }
  p.bits.assign(static_cast<size_t>(n0 * p.stride_b), 0xffff);  // NaN in both dtypes
  return p;
}

inline Packed pack(const Tensor& t, DType dtype, Layout layout) {
  Packed p = layout_of(t.n0, t.n1, t.n2, t.n3, layout);
  for (int64_t b = 0; b < t.n0; ++b)
    for (int64_t h = 0; h < t.n1; ++h)
      for (int64_t s = 0; s < t.n2; ++s)
        for (int64_t c = 0; c < t.n3; ++c) {
          const float x = t.at(b, h, s, c);
          p.bits[static_cast<size_t>(p.offset(b, h, s, c))] =
              dtype == DType::kFloat16 ? float_to_fp16(x) : float_to_bf16(x);
        }
  return p;
}

inline Tensor unpack(const Packed& p, DType dtype) {
  Tensor t(p.n0, p.n1, p.n2, p.n3);
  for (int64_t b = 0; b < p.n0; ++b)
    for (int64_t h = 0; h < p.n1; ++h)
      for (int64_t s = 0; s < p.n2; ++s)
        for (int64_t c = 0; c < p.n3; ++c) {
          const uint16_t x = p.bits[static_cast<size_t>(p.offset(b, h, s, c))];
          t.at(b, h, s, c) = dtype == DType::kFloat16 ? fp16_to_float(x) : bf16_to_float(x);
        }
  return t;
}

// Padding elements (outside the view) that no longer hold the 0xFFFF poison.
inline int64_t padding_written(const Packed& p) {
  std::vector<char> logical(p.bits.size(), 0);
  for (int64_t b = 0; b < p.n0; ++b)
    for (int64_t h = 0; h < p.n1; ++h)
      for (int64_t s = 0; s < p.n2; ++s)
        for (int64_t c = 0; c < p.n3; ++c) logical[static_cast<size_t>(p.offset(b, h, s, c))] = 1;
  int64_t n = 0;
  for (size_t i = 0; i < p.bits.size(); ++i) n += !logical[i] && p.bits[i] != 0xffff;
  return n;
}

inline int64_t non_finite(const std::vector<float>& v) {
  int64_t n = 0;
  for (float x : v) n += !std::isfinite(x);
  return n;
}

// Relative L2 error ||a - b|| / ||b||.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The CPU reference in fp32 on the same rounded values (contiguous fp32 buffers).
inline Config cpu_config(const Config& cfg) {
  Config c = cfg;
  c.dtype = DType::kFloat32;
  c.layout = Layout::kContiguous;
  return c;
}

// One shape of a parameterised test.
struct ShapeCase {
  const char* name;
  Dims d;
  std::vector<int32_t> cuts;  // interior document boundaries over B*S tokens; empty: none
  Layout layout = Layout::kContiguous;
};

// GoogleTest prints a shape parameter (in test listings and failures) by name and dimensions.
inline void PrintTo(const ShapeCase& sc, std::ostream* os) {
  const Dims& d = sc.d;
  *os << sc.name << " (B" << d.B << " S" << d.S << " H" << d.H << " Hk" << d.Hk << " Hp" << d.Hp
      << " Hpk" << d.Hpk << " D" << d.D << " Dp" << d.Dp << " K" << d.K;
  for (size_t x = 0; x < sc.cuts.size(); ++x)
    *os << (x == 0 ? ", document cuts " : "/") << sc.cuts[x];
  if (sc.layout == Layout::kTokenMajor) *os << ", token-major";
  *os << ")";
}

inline Config case_config(const ShapeCase& sc, DType dtype) {
  Config cfg;
  cfg.d = sc.d;
  cfg.dtype = dtype;
  cfg.layout = sc.layout;
  if (!sc.cuts.empty()) cfg.cu_seqlens = make_cu_seqlens(sc.d, sc.cuts);
  return cfg;
}

// The shapes both the forward and the backward run against the CPU backend: ragged S, B = 2,
// packed documents, K > number of blocks, G in {1, 2, 4, 16}, token-major strided views.
inline std::vector<ShapeCase> attention_shapes() {
  return {
      {"S256_G4_D64",
       {.B = 1, .S = 256, .H = 8, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 64, .Dp = 64, .K = 2}},
      {"S700_G16_D128_ragged",
       {.B = 1, .S = 700, .H = 16, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 128, .Dp = 128, .K = 3}},
      {"B2_S500_G1_D32",
       {.B = 2, .S = 500, .H = 4, .Hk = 4, .Hp = 4, .Hpk = 2, .D = 32, .Dp = 32, .K = 2}},
      {"B2_S640_G4_docs",
       {.B = 2, .S = 640, .H = 8, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 128, .Dp = 64, .K = 2},
       {37, 300, 301, 900}},
      {"S300_K5_exceeds_blocks",
       {.B = 1, .S = 300, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 64, .Dp = 32, .K = 5}},
      {"B2_S400_G2_token_major_docs",
       {.B = 2, .S = 400, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 2, .D = 64, .Dp = 64, .K = 2},
       {150, 610},
       Layout::kTokenMajor},
  };
}

// Shapes only the sparse kernels take: a group size that does not divide the 128-row tile, and
// G = 32 (beyond the warmup kernels' 16).
inline std::vector<ShapeCase> sparse_shapes() {
  return {
      {"S777_G3_D64_Dp32",
       {.B = 1, .S = 777, .H = 6, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 64, .Dp = 32, .K = 3}},
      {"B2_S640_G32_D128_docs",
       {.B = 2, .S = 640, .H = 32, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 128, .Dp = 128, .K = 3},
       {90, 700}},
  };
}

// Shapes of the Hopper warmup kernels (D = Dp = 128): G = 64 (the portable warmup kernels take
// G <= 16) with packed documents and B = 2; several proxy heads per kv head and per proxy key
// head with ragged S, token-major views and a document shorter than a block.
inline std::vector<ShapeCase> warmup_shapes() {
  return {
      {"B2_S700_G64_D128_docs",
       {.B = 2, .S = 700, .H = 64, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 128, .Dp = 128, .K = 1},
       {90, 600, 1000}},
      {"S1000_G4_Hp4_Hpk2_token_major_docs",
       {.B = 1, .S = 1000, .H = 16, .Hk = 2, .Hp = 4, .Hpk = 2, .D = 128, .Dp = 128, .K = 1},
       {300, 350},
       Layout::kTokenMajor},
  };
}

// G > 16 runs only on the Hopper warmup kernels: true (and a skip message) where they do not run.
inline bool skip_without_hopper_warmup(const Config& cfg) {
  return cfg.d.H / cfg.d.Hp > 16 &&
         cuda::warmup_kernels(cfg.problem()) != cuda::Kernels::kHopper;
}

// Parameters (shape, dtype, warmup) of the forward and backward tests, named
// "<shape>_<bf16|fp16>_<sparse|warmup>".
using ModeParam = std::tuple<ShapeCase, DType, bool /*warmup*/>;

inline std::string mode_case_name(const ::testing::TestParamInfo<ModeParam>& info) {
  const auto& [sc, dtype, warmup] = info.param;
  return std::string(sc.name) + (dtype == DType::kBFloat16 ? "_bf16" : "_fp16") +
         (warmup ? "_warmup" : "_sparse");
}

// Forces the portable (mma.sync) kernels while alive: on a Hopper GPU the default path of the
// covered shapes is the sm_90a one, so the path of sm_80 and sm_100a is tested this way.
class PortableKernels {
 public:
  PortableKernels() { setenv("FLASH_MSA_PORTABLE_KERNELS", "1", 1); }
  ~PortableKernels() { unsetenv("FLASH_MSA_PORTABLE_KERNELS"); }
  PortableKernels(const PortableKernels&) = delete;
  PortableKernels& operator=(const PortableKernels&) = delete;
};

// Fixtures whose tests are skipped when no CUDA device is present.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

template <class Param>
class CudaTestWithParam : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

}  // namespace flash_msa::test
