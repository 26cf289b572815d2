// Test helpers: random MSA problems, host buffers in any dtype and layout, and calls into the
// CPU backend that poison every output first and check afterwards that each element was written
// (and that nothing outside a strided view was touched).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <vector>

#include "flash_msa/cpu.h"
#include "flash_msa/msa.h"
#include "host_data.h"

namespace flash_msa {

// GoogleTest prints DType parameters by name (found by argument-dependent lookup).
inline void PrintTo(DType dtype, std::ostream* os) { *os << dtype_name(dtype); }

}  // namespace flash_msa

namespace flash_msa::test {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
inline constexpr int32_t kIndexPoison = std::numeric_limits<int32_t>::min() + 7;

// ---- values in a dtype (shared with the CLI: host_data.h) ----

using host::bf16_to_float;
using host::element_size;
using host::float_to_bf16;
using host::float_to_fp16;
using host::fp16_to_float;
using host::round_to;

// ---- shapes and logical tensors ----

struct Dims {
  int64_t B = 1, S = 1, H = 1, Hk = 1, Hp = 1, Hpk = 1, D = 8, Dp = 8, K = 1;
  int64_t NB() const { return (S + kBlockSize - 1) / kBlockSize; }
};

// A logical float tensor, contiguous [n0, n1, n2, n3].
struct Tensor {
  int64_t n0 = 0, n1 = 0, n2 = 0, n3 = 0;
  std::vector<float> v;

  Tensor() = default;
  Tensor(int64_t a, int64_t b, int64_t c, int64_t d)
      : n0(a), n1(b), n2(c), n3(d), v(static_cast<size_t>(a * b * c * d), kNaN) {}
  size_t size() const { return v.size(); }
  size_t index(int64_t b, int64_t h, int64_t s, int64_t c) const {
    return static_cast<size_t>(((b * n1 + h) * n2 + s) * n3 + c);
  }
  float& at(int64_t b, int64_t h, int64_t s, int64_t c) { return v[index(b, h, s, c)]; }
  float at(int64_t b, int64_t h, int64_t s, int64_t c) const { return v[index(b, h, s, c)]; }
};

inline Tensor random_tensor(int64_t a, int64_t b, int64_t c, int64_t d, std::mt19937& rng,
                            float sd = 1.f) {
  Tensor t(a, b, c, d);
  std::normal_distribution<float> dist(0.f, sd);
  for (float& x : t.v) x = dist(rng);
  return t;
}

struct Inputs {
  Tensor qp, kp, q, k, v, dout;
};

// Random inputs, rounded to `dtype` so that every dtype run reads the same values.
inline Inputs random_inputs(const Dims& d, uint32_t seed, DType dtype = DType::kFloat32,
                            float proxy_sd = 1.f) {
  std::mt19937 rng(seed);
  Inputs in;
  in.qp = random_tensor(d.B, d.Hp, d.S, d.Dp, rng, proxy_sd);
  in.kp = random_tensor(d.B, d.Hpk, d.S, d.Dp, rng, proxy_sd);
  in.q = random_tensor(d.B, d.H, d.S, d.D, rng);
  in.k = random_tensor(d.B, d.Hk, d.S, d.D, rng);
  in.v = random_tensor(d.B, d.Hk, d.S, d.D, rng);
  in.dout = random_tensor(d.B, d.H, d.S, d.D, rng);
  for (Tensor* t : {&in.qp, &in.kp, &in.q, &in.k, &in.v, &in.dout}) {
    for (float& x : t->v) x = round_to(dtype, x);
  }
  return in;
}

// ---- host buffers in a dtype and layout ----

enum class Layout {
  kContiguous,  // [B, H, S, C]
  kTokenMajor,  // [B, S, H, C] with padding between heads, tokens and batch rows
};

inline constexpr int64_t kPadHead = 3, kPadToken = 5, kPadBatch = 7;

class Buffer {
 public:
  Buffer(DType dtype, Layout layout, int64_t n0, int64_t n1, int64_t n2, int64_t n3)
      : dtype_(dtype), n0_(n0), n1_(n1), n2_(n2), n3_(n3) {
    if (layout == Layout::kContiguous) {
      ss_ = n3;
      sh_ = n2 * n3;
      sb_ = n1 * n2 * n3;
      total_ = n0 * sb_;
    } else {
      sh_ = n3 + kPadHead;
      ss_ = n1 * sh_ + kPadToken;
      sb_ = n2 * ss_ + kPadBatch;
      total_ = n0 * sb_;
    }
    bytes_.resize(static_cast<size_t>(total_) * element_size(dtype));
    for (int64_t i = 0; i < total_; ++i) set_raw(i, kNaN);
  }

  static Buffer from(const Tensor& t, DType dtype, Layout layout) {
    Buffer buf(dtype, layout, t.n0, t.n1, t.n2, t.n3);
    for (int64_t b = 0; b < t.n0; ++b)
      for (int64_t h = 0; h < t.n1; ++h)
        for (int64_t s = 0; s < t.n2; ++s)
          for (int64_t c = 0; c < t.n3; ++c) buf.set_raw(buf.offset(b, h, s, c), t.at(b, h, s, c));
    return buf;
  }

  int64_t offset(int64_t b, int64_t h, int64_t s, int64_t c) const {
    return b * sb_ + h * sh_ + s * ss_ + c;
  }

  Tensor to_tensor() const {
    Tensor t(n0_, n1_, n2_, n3_);
    for (int64_t b = 0; b < n0_; ++b)
      for (int64_t h = 0; h < n1_; ++h)
        for (int64_t s = 0; s < n2_; ++s)
          for (int64_t c = 0; c < n3_; ++c) t.at(b, h, s, c) = get_raw(offset(b, h, s, c));
    return t;
  }

  // Logical elements still holding the NaN poison (or any NaN).
  int64_t nan_count() const {
    int64_t n = 0;
    for (int64_t b = 0; b < n0_; ++b)
      for (int64_t h = 0; h < n1_; ++h)
        for (int64_t s = 0; s < n2_; ++s)
          for (int64_t c = 0; c < n3_; ++c) n += std::isnan(get_raw(offset(b, h, s, c)));
    return n;
  }

  // Elements outside the view (padding) that no longer hold the poison.
  int64_t padding_written() const {
    std::vector<char> logical(static_cast<size_t>(total_), 0);
    for (int64_t b = 0; b < n0_; ++b)
      for (int64_t h = 0; h < n1_; ++h)
        for (int64_t s = 0; s < n2_; ++s)
          for (int64_t c = 0; c < n3_; ++c) logical[static_cast<size_t>(offset(b, h, s, c))] = 1;
    int64_t n = 0;
    for (int64_t i = 0; i < total_; ++i)
      n += !logical[static_cast<size_t>(i)] && !std::isnan(get_raw(i));
    return n;
  }

  ConstView cview() const { return {bytes_.data(), sb_, sh_, ss_}; }
  MutView mview() { return {bytes_.data(), sb_, sh_, ss_}; }

 private:
  float get_raw(int64_t i) const { return host::load_element(dtype_, bytes_.data(), i); }
  void set_raw(int64_t i, float f) { host::store_element(dtype_, bytes_.data(), i, f); }

  DType dtype_;
  int64_t n0_, n1_, n2_, n3_;
  int64_t sb_ = 0, sh_ = 0, ss_ = 0, total_ = 0;
  std::vector<unsigned char> bytes_;
};

// ---- how to call the backend ----

struct Config {
  Dims d;
  DType dtype = DType::kFloat32;
  Layout layout = Layout::kContiguous;
  std::vector<int32_t> cu_seqlens;  // empty: one document per batch row
  float scale = 0.f;                // 0: D ** -0.5
  float proxy_scale = 0.f;          // 0: Dp ** -0.5

  float main_scale() const { return scale != 0.f ? scale : 1.f / std::sqrt(float(d.D)); }
  float proxy() const { return proxy_scale != 0.f ? proxy_scale : 1.f / std::sqrt(float(d.Dp)); }

  Problem problem() const {
    Problem p;
    p.batch = d.B;
    p.seqlen = d.S;
    p.heads = d.H;
    p.kv_heads = d.Hk;
    p.proxy_heads = d.Hp;
    p.proxy_kv_heads = d.Hpk;
    p.head_dim = d.D;
    p.proxy_head_dim = d.Dp;
    p.top_k = d.K;
    p.scale = main_scale();
    p.proxy_scale = proxy();
    p.dtype = dtype;
    if (!cu_seqlens.empty()) {
      p.cu_seqlens = cu_seqlens.data();
      p.num_docs = static_cast<int64_t>(cu_seqlens.size()) - 1;
    }
    return p;
  }
  size_t index_count() const { return static_cast<size_t>(d.B * d.Hp * d.S * d.K); }
};

struct Outputs {
  Tensor out;
  std::vector<float> lse, lse_proxy;
  float kl = kNaN;
};

struct Grads {
  Tensor dqp, dkp, dq, dk, dv;
};

inline void expect_all_written(const Buffer& buf, const char* name) {
  EXPECT_EQ(buf.nan_count(), 0) << name << ": elements left unwritten (NaN poison) or NaN";
  EXPECT_EQ(buf.padding_written(), 0) << name << ": wrote outside the view";
}

inline void expect_all_written(const std::vector<float>& v, const char* name) {
  int64_t n = 0;
  for (float x : v) n += std::isnan(x);
  EXPECT_EQ(n, 0) << name << ": elements left unwritten (NaN poison) or NaN";
}

inline std::vector<int32_t> run_select(const Config& cfg, const Inputs& in,
                                       SelectPrecision precision = SelectPrecision::kExact) {
  const Buffer qp = Buffer::from(in.qp, cfg.dtype, cfg.layout);
  const Buffer kp = Buffer::from(in.kp, cfg.dtype, cfg.layout);
  std::vector<int32_t> indices(cfg.index_count(), kIndexPoison);
  SelectParams params{cfg.problem(), qp.cview(), kp.cview(), indices.data(), precision};
  cpu::select(params);
  int64_t unwritten = 0;
  for (int32_t x : indices) unwritten += x == kIndexPoison;
  EXPECT_EQ(unwritten, 0) << "indices: entries left unwritten";
  return indices;
}

inline Outputs run_forward(const Config& cfg, const Inputs& in, bool warmup,
                           const std::vector<int32_t>& indices, bool want_kl = true) {
  const Dims& d = cfg.d;
  const Buffer qp = Buffer::from(in.qp, cfg.dtype, cfg.layout);
  const Buffer kp = Buffer::from(in.kp, cfg.dtype, cfg.layout);
  const Buffer q = Buffer::from(in.q, cfg.dtype, cfg.layout);
  const Buffer k = Buffer::from(in.k, cfg.dtype, cfg.layout);
  const Buffer v = Buffer::from(in.v, cfg.dtype, cfg.layout);
  Buffer out(cfg.dtype, cfg.layout, d.B, d.H, d.S, d.D);
  Outputs res;
  res.lse.assign(static_cast<size_t>(d.B * d.H * d.S), kNaN);
  res.lse_proxy.assign(static_cast<size_t>(d.B * d.Hp * d.S), kNaN);
  float kl = kNaN;
  ForwardParams params;
  params.problem = cfg.problem();
  params.indices = warmup ? nullptr : indices.data();
  params.qp = qp.cview();
  params.kp = kp.cview();
  params.q = q.cview();
  params.k = k.cview();
  params.v = v.cview();
  params.out = out.mview();
  params.lse = res.lse.data();
  params.lse_proxy = res.lse_proxy.data();
  params.kl = want_kl ? &kl : nullptr;
  if (warmup) {
    cpu::warmup_forward(params);
  } else {
    cpu::sparse_forward(params);
  }
  expect_all_written(out, "out");
  expect_all_written(res.lse, "lse");
  expect_all_written(res.lse_proxy, "lse_proxy");
  if (want_kl) {
    EXPECT_FALSE(std::isnan(kl)) << "kl: not written";
  }
  res.out = out.to_tensor();
  res.kl = kl;
  return res;
}

// kl_grad: host pointer to w, or null (w = 0).
inline Grads run_backward(const Config& cfg, const Inputs& in, const Outputs& fwd, bool warmup,
                          const std::vector<int32_t>& indices, const float* kl_grad) {
  const Dims& d = cfg.d;
  const Buffer qp = Buffer::from(in.qp, cfg.dtype, cfg.layout);
  const Buffer kp = Buffer::from(in.kp, cfg.dtype, cfg.layout);
  const Buffer q = Buffer::from(in.q, cfg.dtype, cfg.layout);
  const Buffer k = Buffer::from(in.k, cfg.dtype, cfg.layout);
  const Buffer v = Buffer::from(in.v, cfg.dtype, cfg.layout);
  const Buffer out = Buffer::from(fwd.out, cfg.dtype, cfg.layout);
  const Buffer dout = Buffer::from(in.dout, cfg.dtype, cfg.layout);
  Buffer dqp(cfg.dtype, cfg.layout, d.B, d.Hp, d.S, d.Dp);
  Buffer dkp(cfg.dtype, cfg.layout, d.B, d.Hpk, d.S, d.Dp);
  Buffer dq(cfg.dtype, cfg.layout, d.B, d.H, d.S, d.D);
  Buffer dk(cfg.dtype, cfg.layout, d.B, d.Hk, d.S, d.D);
  Buffer dv(cfg.dtype, cfg.layout, d.B, d.Hk, d.S, d.D);
  BackwardParams params;
  params.problem = cfg.problem();
  params.indices = warmup ? nullptr : indices.data();
  params.qp = qp.cview();
  params.kp = kp.cview();
  params.q = q.cview();
  params.k = k.cview();
  params.v = v.cview();
  params.out = out.cview();
  params.dout = dout.cview();
  params.lse = fwd.lse.data();
  params.lse_proxy = fwd.lse_proxy.data();
  params.kl_grad = kl_grad;
  params.dqp = dqp.mview();
  params.dkp = dkp.mview();
  params.dq = dq.mview();
  params.dk = dk.mview();
  params.dv = dv.mview();
  if (warmup) {
    cpu::warmup_backward(params);
  } else {
    cpu::sparse_backward(params);
  }
  expect_all_written(dqp, "dqp");
  expect_all_written(dkp, "dkp");
  expect_all_written(dq, "dq");
  expect_all_written(dk, "dk");
  expect_all_written(dv, "dv");
  return {dqp.to_tensor(), dkp.to_tensor(), dq.to_tensor(), dk.to_tensor(), dv.to_tensor()};
}

// Packed documents: cu_seqlens over B*S tokens with the given interior cuts (every multiple of S
// is added).
inline std::vector<int32_t> make_cu_seqlens(const Dims& d, std::vector<int32_t> cuts) {
  for (int64_t b = 0; b <= d.B; ++b) cuts.push_back(static_cast<int32_t>(b * d.S));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

// Document id of each flattened token b * S + s.
inline std::vector<int32_t> doc_ids(const Config& cfg) {
  const int64_t n = cfg.d.B * cfg.d.S;
  std::vector<int32_t> doc(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    if (cfg.cu_seqlens.empty()) {
      doc[static_cast<size_t>(t)] = static_cast<int32_t>(t / cfg.d.S);
    } else {
      int32_t id = 0;
      while (id + 1 < static_cast<int32_t>(cfg.cu_seqlens.size()) - 1 &&
             cfg.cu_seqlens[static_cast<size_t>(id) + 1] <= t)
        ++id;
      doc[static_cast<size_t>(t)] = id;
    }
  }
  return doc;
}

// Max |a - b| over all elements, and max |b| (for relative tolerances).
struct Diff {
  double max_abs = 0, max_ref = 0;
};
inline Diff diff(const std::vector<float>& a, const std::vector<float>& b) {
  Diff r;
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    r.max_abs = std::max(r.max_abs, std::fabs(double(a[i]) - double(b[i])));
    if (std::isnan(a[i]) != std::isnan(b[i])) r.max_abs = std::numeric_limits<double>::infinity();
    r.max_ref = std::max(r.max_ref, std::fabs(double(b[i])));
  }
  return r;
}

// Checks a is close to b: max|a-b| <= rel * max|b| + abs.
#define EXPECT_CLOSE(a, b, rel, abs_tol)                                                          \
  do {                                                                                            \
    const ::flash_msa::test::Diff d_ = ::flash_msa::test::diff((a), (b));                         \
    EXPECT_LE(d_.max_abs, (rel)*d_.max_ref + (abs_tol))                                           \
        << #a << " vs " << #b << ": max abs diff " << d_.max_abs << ", max |ref| " << d_.max_ref; \
  } while (0)

}  // namespace flash_msa::test
