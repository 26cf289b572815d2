// CUDA backward, sparse and warmup (SPEC sections 4, 5), against the CPU backend run in fp32 on
// the same bf16/fp16-rounded inputs, the same indices (cpu::select) and the same forward outputs
// (cpu::sparse_forward / warmup_forward: out rounded to the dtype, lse, lse_proxy): dq, dk, dv,
// dqp, dkp; ragged S, B = 2, packed documents, K > number of blocks, G in {1, 2, 4, 16},
// token-major strided views, poisoned outputs and workspace; bitwise determinism; kl_grad null;
// and the paper-shape timing (run when FLASH_MSA_BENCH is set).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/problem.h"
#include "cuda/cuda_test_util.h"
#include "flash_msa/cpu.h"
#include "flash_msa/cuda.h"

namespace flash_msa::test {
namespace {

// The raw 16-bit results, for bitwise comparisons, and their values.
struct CudaGrads {
  Grads g;
  std::vector<std::vector<uint16_t>> bits;
  float kl = kNaN;  // the backward's KL value (want_kl)
};

// Runs the CUDA backward with every output and the workspace poisoned (0xFF bytes = NaN) and
// checks that each output element was written, finite, and nothing outside a view was touched.
CudaGrads run_cuda_backward(const Config& cfg, const Inputs& in, const Outputs& fwd, bool warmup,
                            const std::vector<int32_t>& indices, const float* kl_grad,
                            int64_t max_chunk_tokens = 0, bool want_kl = false) {
  const Dims& d = cfg.d;
  const DType dt = cfg.dtype;
  const Packed qp = pack(in.qp, dt, cfg.layout), kp = pack(in.kp, dt, cfg.layout);
  const Packed q = pack(in.q, dt, cfg.layout), k = pack(in.k, dt, cfg.layout);
  const Packed v = pack(in.v, dt, cfg.layout), out = pack(fwd.out, dt, cfg.layout);
  const Packed dout = pack(in.dout, dt, cfg.layout);
  std::vector<Packed> grads = {
      layout_of(d.B, d.Hp, d.S, d.Dp, cfg.layout), layout_of(d.B, d.Hpk, d.S, d.Dp, cfg.layout),
      layout_of(d.B, d.H, d.S, d.D, cfg.layout), layout_of(d.B, d.Hk, d.S, d.D, cfg.layout),
      layout_of(d.B, d.Hk, d.S, d.D, cfg.layout)};
  auto upload = [](const Packed& p) { return DeviceBuffer(p.bits.data(), p.bits.size() * 2); };
  const DeviceBuffer g_qp = upload(qp), g_kp = upload(kp), g_q = upload(q), g_k = upload(k);
  const DeviceBuffer g_v = upload(v), g_out = upload(out), g_dout = upload(dout);
  DeviceBuffer g_dqp = upload(grads[0]), g_dkp = upload(grads[1]), g_dq = upload(grads[2]);
  DeviceBuffer g_dk = upload(grads[3]), g_dv = upload(grads[4]);
  const DeviceBuffer g_idx(indices.data(), indices.size() * sizeof(int32_t));
  const DeviceBuffer g_cu(cfg.cu_seqlens.data(), cfg.cu_seqlens.size() * sizeof(int32_t));
  const DeviceBuffer g_lse(fwd.lse.data(), fwd.lse.size() * sizeof(float));
  const DeviceBuffer g_lsep(fwd.lse_proxy.data(), fwd.lse_proxy.size() * sizeof(float));
  DeviceBuffer g_w(sizeof(float)), g_kl(sizeof(float));
  EXPECT_EQ(cudaMemset(g_kl.get(), 0xff, sizeof(float)), cudaSuccess);
  if (kl_grad) cudaMemcpy(g_w.get(), kl_grad, sizeof(float), cudaMemcpyHostToDevice);
  BackwardParams params;
  params.problem = cfg.problem();
  params.problem.cu_seqlens =
      cfg.cu_seqlens.empty() ? nullptr : static_cast<const int32_t*>(g_cu.get());
  params.indices = warmup ? nullptr : static_cast<const int32_t*>(g_idx.get());
  auto cview = [](const DeviceBuffer& m, const Packed& p) {
    return ConstView{m.get(), p.stride_b, p.stride_h, p.stride_s};
  };
  auto mview = [](DeviceBuffer& m, const Packed& p) {
    return MutView{m.get(), p.stride_b, p.stride_h, p.stride_s};
  };
  params.qp = cview(g_qp, qp);
  params.kp = cview(g_kp, kp);
  params.q = cview(g_q, q);
  params.k = cview(g_k, k);
  params.v = cview(g_v, v);
  params.out = cview(g_out, out);
  params.dout = cview(g_dout, dout);
  params.lse = static_cast<const float*>(g_lse.get());
  params.lse_proxy = static_cast<const float*>(g_lsep.get());
  params.kl_grad = kl_grad ? static_cast<const float*>(g_w.get()) : nullptr;
  params.kl = want_kl ? g_kl.get() : nullptr;
  params.dqp = mview(g_dqp, grads[0]);
  params.dkp = mview(g_dkp, grads[1]);
  params.dq = mview(g_dq, grads[2]);
  params.dk = mview(g_dk, grads[3]);
  params.dv = mview(g_dv, grads[4]);
  DeviceBuffer ws(cuda::backward_workspace_bytes(params, warmup, max_chunk_tokens));
  EXPECT_EQ(cudaMemset(ws.get(), 0xff, ws.bytes()), cudaSuccess);
  if (warmup) {
    cuda::warmup_backward(params, {ws.get(), ws.bytes()}, nullptr);
  } else {
    cuda::sparse_backward(params, {ws.get(), ws.bytes()}, nullptr);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const DeviceBuffer* dev[5] = {&g_dqp, &g_dkp, &g_dq, &g_dk, &g_dv};
  const char* names[5] = {"dqp", "dkp", "dq", "dk", "dv"};
  CudaGrads res;
  cudaMemcpy(&res.kl, g_kl.get(), sizeof(float), cudaMemcpyDeviceToHost);
  Tensor* dst[5] = {&res.g.dqp, &res.g.dkp, &res.g.dq, &res.g.dk, &res.g.dv};
  for (int t = 0; t < 5; ++t) {
    cudaMemcpy(grads[t].bits.data(), dev[t]->get(), dev[t]->bytes(), cudaMemcpyDeviceToHost);
    *dst[t] = unpack(grads[t], dt);
    EXPECT_EQ(non_finite(dst[t]->v), 0) << names[t] << ": elements unwritten (NaN) or not finite";
    EXPECT_EQ(padding_written(grads[t]), 0) << names[t] << ": wrote outside the view";
    res.bits.push_back(grads[t].bits);
  }
  return res;
}

// The CPU forward, with out rounded to the dtype: the CUDA backward reads out in the dtype, so
// both backends compute Delta = <out, dO> from the same values.
Outputs reference_forward(const Config& ref_cfg, DType dtype, const Inputs& in, bool warmup,
                          const std::vector<int32_t>& indices) {
  Outputs fwd = run_forward(ref_cfg, in, warmup, indices);
  for (float& x : fwd.out.v) x = round_to(dtype, x);
  return fwd;
}

// Tolerances on relative L2 error against the fp32 CPU reference on the same rounded values.
// The kernel rounds P and dS (and pp - t) to the dtype before the second products, as
// FlashAttention does, and rounds the results: each rounding is 2^-9 (bf16) or 2^-11 (fp16)
// relative per element, and a few compound, so 1e-2 for bf16 and 3e-3 for fp16.
void expect_match(const Grads& got, const Grads& want, DType dtype, bool with_proxy) {
  const double tol = dtype == DType::kBFloat16 ? 1e-2 : 3e-3;
  const Tensor* g[5] = {&got.dqp, &got.dkp, &got.dq, &got.dk, &got.dv};
  const Tensor* w[5] = {&want.dqp, &want.dkp, &want.dq, &want.dk, &want.dv};
  const char* names[5] = {"dqp", "dkp", "dq", "dk", "dv"};
  for (int t = with_proxy ? 0 : 2; t < 5; ++t) {
    const double err = rel_l2(g[t]->v, w[t]->v);
    EXPECT_LT(err, tol) << names[t] << ": relative L2 error";
    std::printf("[ bwd ] %s rel L2 %.2e\n", names[t], err);
  }
}

class CudaBackward : public CudaTestWithParam<ModeParam> {};

TEST_P(CudaBackward, MatchesCpu) {
  const auto& [shape, dtype, warmup] = GetParam();
  const Config cfg = case_config(shape, dtype);
  const Inputs in = random_inputs(cfg.d, 4321, dtype);
  const Config ref_cfg = cpu_config(cfg);
  const std::vector<int32_t> indices = warmup ? std::vector<int32_t>() : run_select(ref_cfg, in);
  const Outputs fwd = reference_forward(ref_cfg, dtype, in, warmup, indices);
  // w of order B*Hp*S keeps the proxy gradients of order one, so that relative errors of the
  // fp16 results are not dominated by subnormals.
  const float w = 0.75f * static_cast<float>(cfg.d.B * cfg.d.Hp * cfg.d.S);
  const Grads want = run_backward(ref_cfg, in, fwd, warmup, indices, &w);
  const CudaGrads got = run_cuda_backward(cfg, in, fwd, warmup, indices, &w);
  expect_match(got.g, want, dtype, true);
}

// The forward's shapes, and G = 16 with several proxy and kv heads.
std::vector<ShapeCase> backward_shapes() {
  std::vector<ShapeCase> shapes = attention_shapes();
  shapes.push_back(
      {"S1100_G16_Hp4_Hk2",
       {.B = 1, .S = 1100, .H = 64, .Hk = 2, .Hp = 4, .Hpk = 1, .D = 128, .Dp = 128, .K = 4}});
  return shapes;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackward,
                         ::testing::Combine(::testing::ValuesIn(backward_shapes()),
                                            ::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Bool()),
                         mode_case_name);

// The warmup shapes of the Hopper kernels (G = 64, documents, several proxy heads per kv and
// proxy key head): gradients and the KL value against the CPU backend, and bitwise identical
// repeats (the fixed order of the dQ, dQp adds across key blocks).
using CudaWarmupBackward = CudaTestWithParam<ShapeCase>;

TEST_P(CudaWarmupBackward, MatchesCpuAndRepeats) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const Config cfg = case_config(GetParam(), dtype);
    if (skip_without_hopper_warmup(cfg)) GTEST_SKIP() << "G > 16 needs the Hopper warmup kernels";
    const Inputs in = random_inputs(cfg.d, 8642, dtype);
    const Config ref_cfg = cpu_config(cfg);
    const Outputs fwd = reference_forward(ref_cfg, dtype, in, true, {});
    const float w = 0.75f * static_cast<float>(cfg.d.B * cfg.d.Hp * cfg.d.S);
    const Grads want = run_backward(ref_cfg, in, fwd, true, {}, &w);
    const CudaGrads a = run_cuda_backward(cfg, in, fwd, true, {}, &w, 0, true);
    const CudaGrads b = run_cuda_backward(cfg, in, fwd, true, {}, &w, 0, true);
    expect_match(a.g, want, dtype, true);
    EXPECT_NEAR(a.kl, fwd.kl, 2e-3 * fwd.kl + 1e-5) << "kl";
    EXPECT_EQ(std::memcmp(&a.kl, &b.kl, sizeof(float)), 0) << a.kl << " vs " << b.kl;
    for (size_t t = 0; t < a.bits.size(); ++t)
      EXPECT_TRUE(a.bits[t] == b.bits[t]) << "gradient " << t << " differs between runs";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaWarmupBackward, ::testing::ValuesIn(warmup_shapes()),
                         [](const auto& info) { return std::string(info.param.name); });

void check_sparse_backward(const ShapeCase& sc) {
  const Config cfg = case_config(sc, DType::kBFloat16);
  const Inputs in = random_inputs(cfg.d, 1357, cfg.dtype);
  const Config ref_cfg = cpu_config(cfg);
  const std::vector<int32_t> indices = run_select(ref_cfg, in);
  const Outputs fwd = reference_forward(ref_cfg, cfg.dtype, in, false, indices);
  const float w = 0.75f * static_cast<float>(cfg.d.B * cfg.d.Hp * cfg.d.S);
  const Grads want = run_backward(ref_cfg, in, fwd, false, indices, &w);
  expect_match(run_cuda_backward(cfg, in, fwd, false, indices, &w).g, want, cfg.dtype, true);
}

using CudaSparseBackward = CudaTestWithParam<ShapeCase>;

TEST_P(CudaSparseBackward, MatchesCpu) { check_sparse_backward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSparseBackward, ::testing::ValuesIn(sparse_shapes()),
                         [](const auto& info) { return std::string(info.param.name); });

// On an H100/H200 the D = 128 shapes take the Hopper kernel; here every shape takes the portable
// one, the path of sm_80 and sm_100a.
using CudaBackwardPortable = CudaTest;

TEST_F(CudaBackwardPortable, SparseShapesMatchCpu) {
  const PortableKernels portable;
  std::vector<ShapeCase> shapes = backward_shapes();
  for (const ShapeCase& sc : sparse_shapes()) shapes.push_back(sc);
  for (const ShapeCase& sc : shapes) {
    SCOPED_TRACE(sc.name);
    check_sparse_backward(sc);
  }
}

using CudaBackwardChunks = CudaTest;

// Token chunks (a small workspace): dq and dqp are per-token sums in slot order and keep their
// bits; dk, dv, dkp add the chunks' fp32 sums in another order, within rounding.
// D = 64 and 128 (the Hopper kernel's).
TEST_F(CudaBackwardChunks, ChunkedMatchesOneChunk) {
  for (const int64_t D : {64, 128}) {
    SCOPED_TRACE(D);
    Config cfg;
    cfg.d = {.B = 2, .S = 700, .H = 8, .Hk = 2, .Hp = 4, .Hpk = 1, .D = D, .Dp = 64, .K = 3};
    cfg.dtype = DType::kBFloat16;
    cfg.cu_seqlens = make_cu_seqlens(cfg.d, {200, 900});
    const Inputs in = random_inputs(cfg.d, 57, cfg.dtype);
    const Config ref_cfg = cpu_config(cfg);
    const std::vector<int32_t> indices = run_select(ref_cfg, in);
    const Outputs fwd = reference_forward(ref_cfg, cfg.dtype, in, false, indices);
    const float w = 0.75f * static_cast<float>(cfg.d.B * cfg.d.Hp * cfg.d.S);
    const CudaGrads one = run_cuda_backward(cfg, in, fwd, false, indices, &w);
    const CudaGrads chunked = run_cuda_backward(cfg, in, fwd, false, indices, &w, 128);
    EXPECT_TRUE(one.bits[0] == chunked.bits[0]) << "dqp";
    EXPECT_TRUE(one.bits[2] == chunked.bits[2]) << "dq";
    EXPECT_LT(rel_l2(chunked.g.dkp.v, one.g.dkp.v), 1e-3);
    EXPECT_LT(rel_l2(chunked.g.dk.v, one.g.dk.v), 1e-3);
    EXPECT_LT(rel_l2(chunked.g.dv.v, one.g.dv.v), 1e-3);
    expect_match(chunked.g, run_backward(ref_cfg, in, fwd, false, indices, &w), cfg.dtype, true);
  }
}

Config determinism_config() {
  Config cfg;
  cfg.d = {.B = 2, .S = 900, .H = 16, .Hk = 4, .Hp = 4, .Hpk = 1, .D = 64, .Dp = 64, .K = 3};
  cfg.dtype = DType::kBFloat16;
  cfg.cu_seqlens = make_cu_seqlens(cfg.d, {100, 1333});
  return cfg;
}

using CudaBackwardDeterminism = CudaTest;

// Deterministic mode: two runs give identical bits for every gradient.
// D = 64 and, sparse, 128 (the Hopper kernel's).
TEST_F(CudaBackwardDeterminism, BitwiseIdenticalRuns) {
  for (const auto& [warmup, D] :
       {std::pair{false, 64}, std::pair{true, 64}, std::pair{false, 128}}) {
    SCOPED_TRACE(D);
    Config cfg = determinism_config();
    cfg.d.D = D;
    const Inputs in = random_inputs(cfg.d, 99, cfg.dtype);
    const Config ref_cfg = cpu_config(cfg);
    const std::vector<int32_t> indices = warmup ? std::vector<int32_t>() : run_select(ref_cfg, in);
    const Outputs fwd = reference_forward(ref_cfg, cfg.dtype, in, warmup, indices);
    const float w = 1.f;
    const CudaGrads a = run_cuda_backward(cfg, in, fwd, warmup, indices, &w);
    const CudaGrads b = run_cuda_backward(cfg, in, fwd, warmup, indices, &w);
    for (size_t t = 0; t < a.bits.size(); ++t)
      EXPECT_TRUE(a.bits[t] == b.bits[t]) << "gradient " << t << " differs, warmup " << warmup;
  }
}

using CudaBackwardKlGrad = CudaTest;

// Without kl_grad (w = 0) the proxy gradients are exactly zero and the main ones unchanged.
TEST_F(CudaBackwardKlGrad, NullGivesZeroProxyGradients) {
  Config cfg;
  cfg.d = {.B = 1, .S = 333, .H = 8, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 64, .Dp = 64, .K = 2};
  cfg.dtype = DType::kBFloat16;
  const Inputs in = random_inputs(cfg.d, 77, cfg.dtype);
  const Config ref_cfg = cpu_config(cfg);
  const std::vector<int32_t> indices = run_select(ref_cfg, in);
  const Outputs fwd = reference_forward(ref_cfg, cfg.dtype, in, false, indices);
  const Grads want = run_backward(ref_cfg, in, fwd, false, indices, nullptr);
  const CudaGrads got = run_cuda_backward(cfg, in, fwd, false, indices, nullptr);
  expect_match(got.g, want, cfg.dtype, false);
  for (const Tensor* t : {&got.g.dqp, &got.g.dkp})
    EXPECT_EQ(std::count(t->v.begin(), t->v.end(), 0.f), static_cast<long>(t->v.size()));
}

// The KL value from the backward's teacher (params.kl): the CPU forward's value up to rounding,
// with or without kl_grad, in both modes and with chunking; the gradients stay bitwise those of
// the run without it, and the value is bitwise reproducible.
TEST_F(CudaBackwardKlGrad, WritesTheKlValue) {
  Config cfg;
  cfg.d = {.B = 2, .S = 333, .H = 8, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 128, .Dp = 128, .K = 2};
  cfg.dtype = DType::kBFloat16;
  cfg.cu_seqlens = {0, 150, 333, 500, 666};
  const Inputs in = random_inputs(cfg.d, 78, cfg.dtype);
  const Config ref_cfg = cpu_config(cfg);
  const std::vector<int32_t> indices = run_select(ref_cfg, in);
  const float w = 0.75f;
  for (const bool warmup : {false, true}) {
    const Outputs fwd = reference_forward(ref_cfg, cfg.dtype, in, warmup, indices);
    ASSERT_TRUE(std::isfinite(fwd.kl) && fwd.kl > 0.f);
    for (const float* kl_grad : {&w, static_cast<const float*>(nullptr)}) {
      for (const int64_t chunk : {int64_t{0}, int64_t{128}}) {
        if (warmup && chunk) continue;  // warmup has no chunks
        const CudaGrads plain = run_cuda_backward(cfg, in, fwd, warmup, indices, kl_grad, chunk);
        const CudaGrads a = run_cuda_backward(cfg, in, fwd, warmup, indices, kl_grad, chunk, true);
        const CudaGrads b = run_cuda_backward(cfg, in, fwd, warmup, indices, kl_grad, chunk, true);
        EXPECT_NEAR(a.kl, fwd.kl, 2e-3 * fwd.kl + 1e-5)
            << "warmup " << warmup << ", kl_grad " << (kl_grad != nullptr) << ", chunk " << chunk;
        EXPECT_EQ(std::memcmp(&a.kl, &b.kl, sizeof(float)), 0) << a.kl << " vs " << b.kl;
        for (size_t t = 0; t < plain.bits.size(); ++t)
          EXPECT_TRUE(plain.bits[t] == a.bits[t]) << "gradient " << t << ", warmup " << warmup;
        std::printf("[ bwd kl ] warmup %d, kl_grad %d, chunk %ld: %.6f (cpu forward %.6f)\n",
                    warmup, kl_grad != nullptr, static_cast<long>(chunk), a.kl, fwd.kl);
      }
    }
  }
}

// Fills a 16-bit buffer with N(0, 1)-like values from a counter hash: the paper-shape inputs
// are too large to draw on the host quickly.
__global__ void fill_random(uint16_t* dst, int64_t n, uint32_t seed, float sd) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b9u ^ seed;
    float acc = 0.f;
    for (int r = 0; r < 4; ++r) {
      h ^= h >> 16;
      h *= 0x7feb352du;
      h ^= h >> 15;
      h *= 0x846ca68bu;
      h ^= h >> 16;
      acc += static_cast<float>(h) * 2.3283064e-10f;
    }
    const float x = (acc - 2.f) * 1.7320508f * sd;  // sum of 4 uniforms: mean 2, variance 1/3
    const __nv_bfloat16 v = __float2bfloat16_rn(x);
    dst[i] = *reinterpret_cast<const uint16_t*>(&v);
  }
}

__global__ void fill_value(float* dst, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = value;
}

using CudaBackwardPerf = CudaTest;

// The paper shape at S = 32768 (B=1, H=64, Hk=4, Hp=4, Hpk=1, D=Dp=128, K=16, bf16) with the own
// block plus 15 random earlier distinct blocks per row and synthetic lse (timing needs no exact
// values). FLOPs counted as 2.5 * 4 * H * D * (sum over queries of attended keys).
TEST_F(CudaBackwardPerf, PaperShapeS32K) {
  if (std::getenv("FLASH_MSA_BENCH") == nullptr) GTEST_SKIP() << "set FLASH_MSA_BENCH=1";
  Config cfg;
  cfg.d = {.B = 1, .S = 32768, .H = 64, .Hk = 4, .Hp = 4, .Hpk = 1, .D = 128, .Dp = 128, .K = 16};
  cfg.dtype = DType::kBFloat16;
  const Dims& d = cfg.d;
  std::vector<int32_t> indices(cfg.index_count(), -1);
  std::mt19937 rng(5);
  double attended = 0;
  for (int64_t p = 0; p < d.Hp; ++p)
    for (int64_t i = 0; i < d.S; ++i) {
      const int own = static_cast<int>(i / kBlockSize);
      std::vector<int32_t> blocks = {own};
      if (own <= 15) {
        for (int n = 0; n < own; ++n) blocks.push_back(n);
      } else {
        while (blocks.size() < 16) {
          const int n = static_cast<int>(rng() % own);
          if (std::find(blocks.begin(), blocks.end(), n) == blocks.end()) blocks.push_back(n);
        }
      }
      std::sort(blocks.begin(), blocks.end());
      std::copy(blocks.begin(), blocks.end(), indices.begin() + (p * d.S + i) * d.K);
      attended += (double(blocks.size() - 1) * kBlockSize + double(i % kBlockSize + 1)) /
                  double(d.Hp);  // the G heads of a proxy head share its selection
    }
  const int64_t n_q = d.B * d.H * d.S * d.D, n_k = d.B * d.Hk * d.S * d.D;
  const int64_t n_qp = d.B * d.Hp * d.S * d.Dp, n_kp = d.B * d.Hpk * d.S * d.Dp;
  DeviceBuffer qp(n_qp * 2), kp(n_kp * 2), q(n_q * 2), k(n_k * 2), v(n_k * 2), out(n_q * 2),
      dout(n_q * 2), dqp(n_qp * 2), dkp(n_kp * 2), dq(n_q * 2), dk(n_k * 2), dv(n_k * 2);
  DeviceBuffer lse(d.B * d.H * d.S * 4), lsep(d.B * d.Hp * d.S * 4), w(4);
  DeviceBuffer idx(indices.data(), indices.size() * sizeof(int32_t));
  uint32_t seed = 1;
  const std::pair<DeviceBuffer*, int64_t> inputs[] = {
      {&qp, n_qp}, {&kp, n_kp}, {&q, n_q}, {&k, n_k}, {&v, n_k}, {&out, n_q}, {&dout, n_q}};
  for (const auto& [buf, n] : inputs)
    fill_random<<<1024, 256>>>(static_cast<uint16_t*>(buf->get()), n, seed++, 1.f);
  fill_value<<<256, 256>>>(static_cast<float*>(lse.get()), d.B * d.H * d.S, 8.f);
  fill_value<<<256, 256>>>(static_cast<float*>(lsep.get()), d.B * d.Hp * d.S, 8.f);
  fill_value<<<1, 32>>>(static_cast<float*>(w.get()), 1, 1.f);
  BackwardParams params;
  params.problem = cfg.problem();
  params.indices = static_cast<const int32_t*>(idx.get());
  auto cv = [](const DeviceBuffer& m, int64_t heads, int64_t c) {
    return contiguous_view<const void>(m.get(), heads, 32768, c);
  };
  auto mv = [](DeviceBuffer& m, int64_t heads, int64_t c) {
    return contiguous_view<void>(m.get(), heads, 32768, c);
  };
  params.qp = cv(qp, d.Hp, d.Dp);
  params.kp = cv(kp, d.Hpk, d.Dp);
  params.q = cv(q, d.H, d.D);
  params.k = cv(k, d.Hk, d.D);
  params.v = cv(v, d.Hk, d.D);
  params.out = cv(out, d.H, d.D);
  params.dout = cv(dout, d.H, d.D);
  params.lse = static_cast<const float*>(lse.get());
  params.lse_proxy = static_cast<const float*>(lsep.get());
  params.kl_grad = static_cast<const float*>(w.get());
  params.dqp = mv(dqp, d.Hp, d.Dp);
  params.dkp = mv(dkp, d.Hpk, d.Dp);
  params.dq = mv(dq, d.H, d.D);
  params.dk = mv(dk, d.Hk, d.D);
  params.dv = mv(dv, d.Hk, d.D);
  DeviceBuffer ws(cuda::backward_workspace_bytes(params, false));
  const double flops = 2.5 * 4.0 * double(d.H) * double(d.D) * attended;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int it = 0; it < 7; ++it) {
    cudaEventRecord(start);
    cuda::sparse_backward(params, {ws.get(), ws.bytes()}, nullptr);
    cudaEventRecord(stop);
    ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    if (it > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const float med = ms[ms.size() / 2];
  std::printf("[ perf ] sparse_backward S=32768 (%s kernels): %.3f ms, %.1f TFLOP/s\n",
              cuda::kernels_name(cuda::sparse_kernels(params.problem)), med,
              flops / (med * 1e-3) / 1e12);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

using CudaWarmupPerf = CudaTest;

// Warmup at the paper shape (B=1, H=64, Hk=4, Hp=4, Hpk=1, D=Dp=128, bf16) at S = 32K and 128K:
// the forward without the KL value, then the backward with it, on random inputs (the forward's
// own out, lse and lse_proxy). FLOPs of the main attention alone: 4 (forward) and 10 (backward)
// * H * D * S (S + 1) / 2; the proxy branch's products come on top.
TEST_F(CudaWarmupPerf, PaperShapes) {
  if (std::getenv("FLASH_MSA_BENCH") == nullptr) GTEST_SKIP() << "set FLASH_MSA_BENCH=1";
  for (const int64_t S : {int64_t{32768}, int64_t{131072}}) {
    Config cfg;
    cfg.d = {.B = 1, .S = S, .H = 64, .Hk = 4, .Hp = 4, .Hpk = 1, .D = 128, .Dp = 128, .K = 1};
    cfg.dtype = DType::kBFloat16;
    const Dims& d = cfg.d;
    const int64_t n_q = d.H * S * d.D, n_k = d.Hk * S * d.D, n_qp = d.Hp * S * d.Dp,
                  n_kp = d.Hpk * S * d.Dp;
    DeviceBuffer qp(n_qp * 2), kp(n_kp * 2), q(n_q * 2), k(n_k * 2), v(n_k * 2), out(n_q * 2),
        dout(n_q * 2), dqp(n_qp * 2), dkp(n_kp * 2), dq(n_q * 2), dk(n_k * 2), dv(n_k * 2);
    DeviceBuffer lse(d.H * S * 4), lsep(d.Hp * S * 4), w(4), kl(4);
    uint32_t seed = 11;
    const std::pair<DeviceBuffer*, int64_t> inputs[] = {
        {&qp, n_qp}, {&kp, n_kp}, {&q, n_q}, {&k, n_k}, {&v, n_k}, {&dout, n_q}};
    for (const auto& [buf, n] : inputs)
      fill_random<<<1024, 256>>>(static_cast<uint16_t*>(buf->get()), n, seed++, 1.f);
    fill_value<<<1, 32>>>(static_cast<float*>(w.get()), 1, 1.f);
    auto cv = [S](const DeviceBuffer& m, int64_t heads, int64_t c) {
      return contiguous_view<const void>(m.get(), heads, S, c);
    };
    auto mv = [S](DeviceBuffer& m, int64_t heads, int64_t c) {
      return contiguous_view<void>(m.get(), heads, S, c);
    };
    ForwardParams fp;
    fp.problem = cfg.problem();
    fp.problem.top_k = 0;
    fp.qp = cv(qp, d.Hp, d.Dp);
    fp.kp = cv(kp, d.Hpk, d.Dp);
    fp.q = cv(q, d.H, d.D);
    fp.k = cv(k, d.Hk, d.D);
    fp.v = cv(v, d.Hk, d.D);
    fp.out = mv(out, d.H, d.D);
    fp.lse = static_cast<float*>(lse.get());
    fp.lse_proxy = static_cast<float*>(lsep.get());
    BackwardParams bp;
    bp.problem = fp.problem;
    bp.qp = fp.qp;
    bp.kp = fp.kp;
    bp.q = fp.q;
    bp.k = fp.k;
    bp.v = fp.v;
    bp.out = cv(out, d.H, d.D);
    bp.dout = cv(dout, d.H, d.D);
    bp.lse = fp.lse;
    bp.lse_proxy = fp.lse_proxy;
    bp.kl_grad = static_cast<const float*>(w.get());
    bp.kl = static_cast<float*>(kl.get());
    bp.dqp = mv(dqp, d.Hp, d.Dp);
    bp.dkp = mv(dkp, d.Hpk, d.Dp);
    bp.dq = mv(dq, d.H, d.D);
    bp.dk = mv(dk, d.Hk, d.D);
    bp.dv = mv(dv, d.Hk, d.D);
    DeviceBuffer fws(std::max<size_t>(cuda::forward_workspace_bytes(fp, true), 256));
    DeviceBuffer bws(cuda::backward_workspace_bytes(bp, true));
    const double attended = double(S) * double(S + 1) / 2;
    auto time_ms = [](const auto& fn) {
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      std::vector<float> ms;
      for (int it = 0; it < 4; ++it) {
        cudaEventRecord(start);
        fn();
        cudaEventRecord(stop);
        EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
        float t = 0;
        cudaEventElapsedTime(&t, start, stop);
        if (it > 0) ms.push_back(t);
      }
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      std::sort(ms.begin(), ms.end());
      return ms[ms.size() / 2];
    };
    const float f_ms = time_ms([&] { cuda::warmup_forward(fp, {fws.get(), fws.bytes()}, nullptr); });
    const float b_ms = time_ms([&] { cuda::warmup_backward(bp, {bws.get(), bws.bytes()}, nullptr); });
    float kl_value = 0.f;
    cudaMemcpy(&kl_value, kl.get(), 4, cudaMemcpyDeviceToHost);
    EXPECT_TRUE(std::isfinite(kl_value) && kl_value > 0.f) << kl_value;
    std::printf("[ perf ] warmup S=%ld (%s kernels): forward %.2f ms (%.1f TFLOP/s), backward "
                "with the KL value %.2f ms (%.1f TFLOP/s), kl %.4f\n",
                static_cast<long>(S), cuda::kernels_name(cuda::warmup_kernels(fp.problem)), f_ms,
                4.0 * d.H * d.D * attended / (f_ms * 1e-3) / 1e12, b_ms,
                10.0 * d.H * d.D * attended / (b_ms * 1e-3) / 1e12, kl_value);
  }
}

}  // namespace
}  // namespace flash_msa::test
