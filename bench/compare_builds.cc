// Bitwise digests and timings of the CUDA ops through the public API only, so that the same
// source builds against two versions of the library (bench/compare_builds.sh) and their outputs
// can be compared bit for bit: a change that should not alter what any kernel computes (a
// refactor, a new build flag) must print the same digests.
//
//   compare_builds            digests of every case below (inputs from a fixed seed)
//   compare_builds time CASE  also the median times of select, forward (without and with the
//                             KL value) and backward of CASE, on stderr
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flash_msa/cuda.h"

using namespace flash_msa;

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "CUDA error %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// Device memory, poisoned (0xff) so that an unwritten output shows in its digest.
struct Buf {
  void* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t bytes) : n(bytes) {
    CK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
    CK(cudaMemset(p, 0xff, std::max<size_t>(bytes, 256)));
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
};

uint64_t rng_state = 0;
uint64_t next() {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
float uniform() { return (next() >> 40) * (1.0f / 16777216.0f) * 2.f - 1.f; }

uint16_t to_half_bits(float f, DType dt) {
  if (dt == DType::kBFloat16) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  // fp16 of the values drawn here (|f| <= 2): round to nearest even, tiny values to zero
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = (u >> 16) & 0x8000;
  const uint32_t a = u & 0x7fffffff;
  if (a < 0x38800000) return sign;  // flush tiny
  const uint32_t r = a - (112u << 23);
  return sign | uint16_t((r + 0xfff + ((r >> 13) & 1)) >> 13);
}

void fill(Buf& b, size_t elems, DType dt, float scale) {
  std::vector<uint16_t> h(elems);
  for (auto& x : h) x = to_half_bits(uniform() * scale, dt);
  CK(cudaMemcpy(b.p, h.data(), elems * 2, cudaMemcpyHostToDevice));
}

uint64_t fnv(const Buf& b, size_t bytes) {
  std::vector<unsigned char> h(bytes);
  CK(cudaMemcpy(h.data(), b.p, bytes, cudaMemcpyDeviceToHost));
  uint64_t x = 0xcbf29ce484222325ull;
  for (unsigned char c : h) x = (x ^ c) * 0x100000001b3ull;
  return x;
}

template <class F>
float median_ms(F&& f, int iters) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  f();
  CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    CK(cudaEventSynchronize(b));
    float t;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Case {
  const char* name;
  int64_t B, S, H, Hk, Hp, Hpk, D, Dp, K;
  DType dt;
  std::vector<int32_t> cu;  // empty: none
  bool warmup;
  int64_t max_chunk;
  int timing_iters;  // 0: no timing
};

void run(const Case& c) {
  rng_state = 12345 + c.S * 7 + c.D;
  Problem pb{.batch = c.B,
             .seqlen = c.S,
             .heads = c.H,
             .kv_heads = c.Hk,
             .proxy_heads = c.Hp,
             .proxy_kv_heads = c.Hpk,
             .head_dim = c.D,
             .proxy_head_dim = c.Dp,
             .top_k = c.warmup ? 0 : c.K,
             .scale = 1.f / std::sqrt(float(c.D)),
             .proxy_scale = 1.f / std::sqrt(float(c.Dp)),
             .dtype = c.dt};
  const int64_t T = c.B * c.S;
  Buf qp(T * c.Hp * c.Dp * 2), kp(T * c.Hpk * c.Dp * 2), q(T * c.H * c.D * 2),
      k(T * c.Hk * c.D * 2), v(T * c.Hk * c.D * 2), dout(T * c.H * c.D * 2);
  fill(qp, T * c.Hp * c.Dp, c.dt, 2.f);
  fill(kp, T * c.Hpk * c.Dp, c.dt, 2.f);
  fill(q, T * c.H * c.D, c.dt, 2.f);
  fill(k, T * c.Hk * c.D, c.dt, 2.f);
  fill(v, T * c.Hk * c.D, c.dt, 1.f);
  fill(dout, T * c.H * c.D, c.dt, 1.f);
  Buf cu(c.cu.size() * 4 + 4);
  if (!c.cu.empty()) {
    CK(cudaMemcpy(cu.p, c.cu.data(), c.cu.size() * 4, cudaMemcpyHostToDevice));
    pb.cu_seqlens = static_cast<const int32_t*>(cu.p);
    pb.num_docs = int64_t(c.cu.size()) - 1;
  }
  auto cview = [&](Buf& b, int64_t h, int64_t d) {
    return ConstView{b.p, c.S * h * d, c.S * d, d};
  };
  auto mview = [&](Buf& b, int64_t h, int64_t d) { return MutView{b.p, c.S * h * d, c.S * d, d}; };
  Buf idx(T * c.Hp * std::max<int64_t>(c.K, 1) * 4);
  Buf out(T * c.H * c.D * 2), lse(T * c.H * 4), lsep(T * c.Hp * 4), kl(4), w(4);
  const float wv = 0.75f;
  CK(cudaMemcpy(w.p, &wv, 4, cudaMemcpyHostToDevice));
  Buf dqp(T * c.Hp * c.Dp * 2), dkp(T * c.Hpk * c.Dp * 2), dq(T * c.H * c.D * 2),
      dk(T * c.Hk * c.D * 2), dv(T * c.Hk * c.D * 2);

  SelectParams sp{.problem = pb,
                  .qp = cview(qp, c.Hp, c.Dp),
                  .kp = cview(kp, c.Hpk, c.Dp),
                  .indices = static_cast<int32_t*>(idx.p)};
  ForwardParams fp{};
  fp.problem = pb;
  fp.indices = c.warmup ? nullptr : static_cast<const int32_t*>(idx.p);
  fp.qp = sp.qp;
  fp.kp = sp.kp;
  fp.q = cview(q, c.H, c.D);
  fp.k = cview(k, c.Hk, c.D);
  fp.v = cview(v, c.Hk, c.D);
  fp.out = mview(out, c.H, c.D);
  fp.lse = static_cast<float*>(lse.p);
  fp.lse_proxy = static_cast<float*>(lsep.p);
  fp.kl = static_cast<float*>(kl.p);
  BackwardParams bp{};
  bp.problem = pb;
  bp.indices = fp.indices;
  bp.qp = fp.qp;
  bp.kp = fp.kp;
  bp.q = fp.q;
  bp.k = fp.k;
  bp.v = fp.v;
  bp.out = cview(out, c.H, c.D);
  bp.dout = cview(dout, c.H, c.D);
  bp.lse = fp.lse;
  bp.lse_proxy = fp.lse_proxy;
  bp.kl_grad = static_cast<const float*>(w.p);
  bp.dqp = mview(dqp, c.Hp, c.Dp);
  bp.dkp = mview(dkp, c.Hpk, c.Dp);
  bp.dq = mview(dq, c.H, c.D);
  bp.dk = mview(dk, c.Hk, c.D);
  bp.dv = mview(dv, c.Hk, c.D);

  Buf fws(cuda::forward_workspace_bytes(fp, c.warmup, c.max_chunk));
  Buf bws(cuda::backward_workspace_bytes(bp, c.warmup, c.max_chunk));
  Buf sws(c.warmup ? 0 : cuda::select_workspace_bytes(sp));
  std::printf("%s workspace fwd %zu bwd %zu\n", c.name, fws.n, bws.n);
  if (!c.warmup) cuda::select(sp, {sws.p, sws.n}, nullptr);
  auto fwd = [&] {
    if (c.warmup)
      cuda::warmup_forward(fp, {fws.p, fws.n}, nullptr);
    else
      cuda::sparse_forward(fp, {fws.p, fws.n}, nullptr);
  };
  auto bwd = [&] {
    if (c.warmup)
      cuda::warmup_backward(bp, {bws.p, bws.n}, nullptr);
    else
      cuda::sparse_backward(bp, {bws.p, bws.n}, nullptr);
  };
  fwd();
  bwd();
  CK(cudaDeviceSynchronize());
  if (!c.warmup)
    std::printf("%s indices %016llx\n", c.name, (unsigned long long)fnv(idx, T * c.Hp * c.K * 4));
  std::printf("%s out %016llx\n", c.name, (unsigned long long)fnv(out, out.n));
  std::printf("%s lse %016llx\n", c.name, (unsigned long long)fnv(lse, lse.n));
  std::printf("%s lse_proxy %016llx\n", c.name, (unsigned long long)fnv(lsep, lsep.n));
  std::printf("%s kl %016llx\n", c.name, (unsigned long long)fnv(kl, 4));
  std::printf("%s dq %016llx\n", c.name, (unsigned long long)fnv(dq, dq.n));
  std::printf("%s dk %016llx\n", c.name, (unsigned long long)fnv(dk, dk.n));
  std::printf("%s dv %016llx\n", c.name, (unsigned long long)fnv(dv, dv.n));
  std::printf("%s dqp %016llx\n", c.name, (unsigned long long)fnv(dqp, dqp.n));
  std::printf("%s dkp %016llx\n", c.name, (unsigned long long)fnv(dkp, dkp.n));
  if (c.timing_iters > 0) {
    if (!c.warmup)
      std::fprintf(stderr, "TIME %s select %.3f ms\n", c.name,
                   median_ms(
                       [&] {
                         cuda::select(sp, {sws.p, sws.n}, nullptr);
                       },
                       c.timing_iters));
    auto klp = fp.kl;
    fp.kl = nullptr;
    std::fprintf(stderr, "TIME %s forward %.3f ms\n", c.name, median_ms(fwd, c.timing_iters));
    fp.kl = klp;
    std::fprintf(stderr, "TIME %s forward_kl %.3f ms\n", c.name, median_ms(fwd, c.timing_iters));
    std::fprintf(stderr, "TIME %s backward %.3f ms\n", c.name, median_ms(bwd, c.timing_iters));
  }
}

int main(int argc, char** argv) {
  const bool timing = argc > 1 && std::strcmp(argv[1], "time") == 0;
  const int it = timing ? 15 : 0;
  const std::vector<Case> cases = {
      {"paper32k", 1, 32768, 64, 4, 4, 1, 128, 128, 16, DType::kBFloat16, {}, false, 0, it},
      {"paper128k", 1, 131072, 64, 4, 4, 1, 128, 128, 16, DType::kBFloat16, {}, false, 0, it},
      {"paper32k_fp16", 1, 32768, 64, 4, 4, 1, 128, 128, 16, DType::kFloat16, {}, false, 0, 0},
      {"d128dp64_chunks",
       2,
       8192,
       32,
       4,
       4,
       2,
       128,
       64,
       8,
       DType::kBFloat16,
       {0, 3000, 8192, 9000, 16384},
       false,
       2048,
       0},
      {"d64_docs_chunks",
       2,
       4096,
       16,
       2,
       4,
       2,
       64,
       64,
       8,
       DType::kFloat16,
       {0, 1000, 4096, 5000, 8192},
       false,
       1024,
       0},
      {"d32", 1, 2048, 8, 2, 2, 1, 32, 32, 4, DType::kBFloat16, {}, false, 0, 0},
      {"warmup", 1, 4096, 16, 4, 4, 1, 128, 128, 0, DType::kBFloat16, {0, 1500, 4096}, true, 0, 0},
      {"warmup_d64", 2, 2048, 8, 2, 2, 1, 64, 32, 0, DType::kFloat16, {}, true, 0, 0},
  };
  const char* only = argc > 2 ? argv[2] : nullptr;
  for (const Case& c : cases)
    if (!only || std::strcmp(only, c.name) == 0) run(c);
  return 0;
}
