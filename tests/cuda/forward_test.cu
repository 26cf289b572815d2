// CUDA main attention forward, sparse and warmup (SPEC sections 2, 3, 5), against the CPU
// backend run in fp32 on the same bf16/fp16-rounded inputs and the same indices (from
// cpu::select): out, lse, lse_proxy, kl; ragged S, B = 2, packed documents, K > number of blocks,
// G in {1, 2, 4, 16}, strided views, poisoned outputs; the tile path of per-block selections;
// golden cases; the backend's limits; determinism of kl; and (disabled by default) the
// paper-shape timing.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/golden.h"
#include "common/npy.h"
#include "common/problem.h"
#include "cuda/cuda_test_util.h"
#include "flash_msa/cpu.h"
#include "flash_msa/cuda.h"

namespace flash_msa::test {
namespace {

struct CudaOutputs {
  Tensor out;
  std::vector<float> lse, lse_proxy;
  float kl = kNaN;
};

// Runs the CUDA forward with every output poisoned (0xFF bytes = NaN) and checks that each
// element was written, finite, and that nothing outside the strided out view was touched.
CudaOutputs run_cuda_forward(const Config& cfg, const Inputs& in, bool warmup,
                             const std::vector<int32_t>& indices, bool want_kl = true,
                             int64_t max_chunk_tokens = 0) {
  const Dims& d = cfg.d;
  const Packed qp = pack(in.qp, cfg.dtype, cfg.layout), kp = pack(in.kp, cfg.dtype, cfg.layout);
  const Packed q = pack(in.q, cfg.dtype, cfg.layout), k = pack(in.k, cfg.dtype, cfg.layout);
  const Packed v = pack(in.v, cfg.dtype, cfg.layout);
  Packed out = layout_of(d.B, d.H, d.S, d.D, cfg.layout);
  DeviceMemory dqp(qp.bits.data(), qp.bits.size() * 2), dkp(kp.bits.data(), kp.bits.size() * 2);
  DeviceMemory dq(q.bits.data(), q.bits.size() * 2), dk(k.bits.data(), k.bits.size() * 2);
  DeviceMemory dv(v.bits.data(), v.bits.size() * 2);
  DeviceMemory dout(out.bits.data(), out.bits.size() * 2);
  DeviceMemory didx(indices.data(), indices.size() * sizeof(int32_t));
  DeviceMemory dcu(cfg.cu_seqlens.data(), cfg.cu_seqlens.size() * sizeof(int32_t));
  CudaOutputs res;
  res.lse.assign(static_cast<size_t>(d.B * d.H * d.S), kNaN);
  res.lse_proxy.assign(static_cast<size_t>(d.B * d.Hp * d.S), kNaN);
  DeviceMemory dlse(res.lse.size() * sizeof(float)), dlsep(res.lse_proxy.size() * sizeof(float));
  DeviceMemory dkl(sizeof(float));
  cudaMemset(dlse.get(), 0xff, dlse.bytes());
  cudaMemset(dlsep.get(), 0xff, dlsep.bytes());
  cudaMemset(dkl.get(), 0xff, dkl.bytes());
  ForwardParams params;
  params.problem = cfg.problem();
  params.problem.cu_seqlens =
      cfg.cu_seqlens.empty() ? nullptr : static_cast<const int32_t*>(dcu.get());
  params.indices = warmup ? nullptr : static_cast<const int32_t*>(didx.get());
  params.qp = {dqp.get(), qp.stride_b, qp.stride_h, qp.stride_s};
  params.kp = {dkp.get(), kp.stride_b, kp.stride_h, kp.stride_s};
  params.q = {dq.get(), q.stride_b, q.stride_h, q.stride_s};
  params.k = {dk.get(), k.stride_b, k.stride_h, k.stride_s};
  params.v = {dv.get(), v.stride_b, v.stride_h, v.stride_s};
  params.out = {dout.get(), out.stride_b, out.stride_h, out.stride_s};
  params.lse = static_cast<float*>(dlse.get());
  params.lse_proxy = static_cast<float*>(dlsep.get());
  params.kl = want_kl ? static_cast<float*>(dkl.get()) : nullptr;
  DeviceMemory ws(cuda::forward_workspace_bytes(params, warmup, max_chunk_tokens));
  // The workspace is poisoned too: the kernel must not depend on its contents.
  cudaMemset(ws.get(), 0xff, ws.bytes());
  if (warmup) {
    cuda::warmup_forward(params, {ws.get(), ws.bytes()}, nullptr);
  } else {
    cuda::sparse_forward(params, {ws.get(), ws.bytes()}, nullptr);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(out.bits.data(), dout.get(), dout.bytes(), cudaMemcpyDeviceToHost);
  cudaMemcpy(res.lse.data(), dlse.get(), dlse.bytes(), cudaMemcpyDeviceToHost);
  cudaMemcpy(res.lse_proxy.data(), dlsep.get(), dlsep.bytes(), cudaMemcpyDeviceToHost);
  cudaMemcpy(&res.kl, dkl.get(), sizeof(float), cudaMemcpyDeviceToHost);
  res.out = unpack(out, cfg.dtype);
  EXPECT_EQ(non_finite(res.out.v), 0) << "out: elements unwritten (NaN poison) or not finite";
  EXPECT_EQ(padding_written(out), 0) << "out: wrote outside the view";
  EXPECT_EQ(non_finite(res.lse), 0) << "lse: elements unwritten or not finite";
  EXPECT_EQ(non_finite(res.lse_proxy), 0) << "lse_proxy: elements unwritten or not finite";
  if (want_kl) {
    EXPECT_TRUE(std::isfinite(res.kl)) << "kl: not written";
  } else {
    uint32_t bits;
    std::memcpy(&bits, &res.kl, 4);
    EXPECT_EQ(bits, 0xffffffffu) << "kl: written although not requested";
  }
  return res;
}

// Tolerances. out: bf16 output rounding alone is ~2^-9 relative per element and P is rounded to
// the input dtype before the PV product (as in FlashAttention), so rel. L2 < 1e-2 for bf16 and
// < 2e-3 for fp16 (2^-11). lse, lse_proxy and kl come from fp32 scores of identical rounded
// inputs (products are exact on tensor cores; only summation order differs), so they match to
// fp32 accumulation error.
void expect_match(const CudaOutputs& got, const Outputs& want, DType dtype, bool with_kl) {
  const double out_tol = dtype == DType::kBFloat16 ? 1e-2 : 2e-3;
  const double out_err = rel_l2(got.out.v, want.out.v);
  EXPECT_LT(out_err, out_tol) << "out: relative L2 error";
  EXPECT_CLOSE(got.lse, want.lse, 1e-5, 1e-3);
  EXPECT_CLOSE(got.lse_proxy, want.lse_proxy, 1e-5, 1e-3);
  if (with_kl) {
    EXPECT_NEAR(got.kl, want.kl, 2e-3 * std::fabs(want.kl) + 1e-5) << "kl";
  }
  std::printf("[ fwd ] out rel L2 %.2e, kl %.6f (cpu %.6f)\n", out_err, got.kl, want.kl);
}

class CudaForward : public CudaTestWithParam<ModeParam> {};

TEST_P(CudaForward, MatchesCpu) {
  const auto& [shape, dtype, warmup] = GetParam();
  const Config cfg = case_config(shape, dtype);
  const Inputs in = random_inputs(cfg.d, 1234, dtype);
  const Config ref_cfg = cpu_config(cfg);
  const std::vector<int32_t> indices = warmup ? std::vector<int32_t>() : run_select(ref_cfg, in);
  const Outputs want = run_forward(ref_cfg, in, warmup, indices);
  const CudaOutputs got = run_cuda_forward(cfg, in, warmup, indices);
  expect_match(got, want, dtype, true);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaForward,
                         ::testing::Combine(::testing::ValuesIn(attention_shapes()),
                                            ::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Bool()),
                         mode_case_name);

// The warmup forward on the Hopper kernels' shapes (on an H100/H200), without and with the KL
// value.
using CudaWarmupForward = CudaTestWithParam<ShapeCase>;

TEST_P(CudaWarmupForward, WithoutKlMatchesCpu) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const Config cfg = case_config(GetParam(), dtype);
    if (skip_without_hopper_warmup(cfg)) GTEST_SKIP() << "G > 16 needs the Hopper warmup kernels";
    const Inputs in = random_inputs(cfg.d, 97, dtype);
    const Outputs want = run_forward(cpu_config(cfg), in, true, {});
    const CudaOutputs got = run_cuda_forward(cfg, in, true, {}, false);
    expect_match(got, want, dtype, false);
    // Asked for the KL value, the forward also runs the portable kernels' second walk (G <= 16),
    // and every other output keeps its bits; the portable kernels alone, without the value.
    if (cfg.d.H / cfg.d.Hp > 16) continue;
    {
      const PortableKernels portable;
      expect_match(run_cuda_forward(cfg, in, true, {}, false), want, dtype, false);
    }
    const CudaOutputs with_kl = run_cuda_forward(cfg, in, true, {}, true);
    EXPECT_NEAR(with_kl.kl, want.kl, 2e-3 * std::fabs(want.kl) + 1e-5) << "kl";
    EXPECT_EQ(with_kl.out.v, got.out.v);
    EXPECT_EQ(with_kl.lse, got.lse);
    EXPECT_EQ(with_kl.lse_proxy, got.lse_proxy);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaWarmupForward, ::testing::ValuesIn(warmup_shapes()),
                         [](const auto& info) { return std::string(info.param.name); });

void check_sparse_forward(const ShapeCase& sc) {
  const Config cfg = case_config(sc, DType::kBFloat16);
  const Inputs in = random_inputs(cfg.d, 2468, cfg.dtype);
  const Config ref_cfg = cpu_config(cfg);
  const std::vector<int32_t> indices = run_select(ref_cfg, in);
  expect_match(run_cuda_forward(cfg, in, false, indices), run_forward(ref_cfg, in, false, indices),
               cfg.dtype, true);
}

using CudaSparseForward = CudaTestWithParam<ShapeCase>;

TEST_P(CudaSparseForward, MatchesCpu) { check_sparse_forward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSparseForward, ::testing::ValuesIn(sparse_shapes()),
                         [](const auto& info) { return std::string(info.param.name); });

// On an H100/H200 the D = 128 shapes take the Hopper kernel; here every shape takes the portable
// one, the path of sm_80 and sm_100a.
using CudaForwardPortable = CudaTest;

TEST_F(CudaForwardPortable, SparseShapesMatchCpu) {
  const PortableKernels portable;
  std::vector<ShapeCase> shapes = attention_shapes();
  for (const ShapeCase& sc : sparse_shapes()) shapes.push_back(sc);
  for (const ShapeCase& sc : shapes) {
    SCOPED_TRACE(sc.name);
    check_sparse_forward(sc);
  }
}

using CudaForwardChunks = CudaTest;

// Small workspaces split the sequence into token chunks; every output is a fixed-order merge of
// per-block partials, so the bits do not change. D = 64 and 128 (the Hopper kernel's).
TEST_F(CudaForwardChunks, SameBitsAsOneChunk) {
  for (const int64_t D : {64, 128}) {
    SCOPED_TRACE(D);
    Config cfg;
    cfg.d = {.B = 2, .S = 700, .H = 8, .Hk = 2, .Hp = 2, .Hpk = 1, .D = D, .Dp = 64, .K = 3};
    cfg.dtype = DType::kBFloat16;
    cfg.cu_seqlens = make_cu_seqlens(cfg.d, {200, 900});
    const Inputs in = random_inputs(cfg.d, 31, cfg.dtype);
    const std::vector<int32_t> indices = run_select(cpu_config(cfg), in);
    const CudaOutputs one = run_cuda_forward(cfg, in, false, indices);
    const CudaOutputs chunked = run_cuda_forward(cfg, in, false, indices, true, 128);
    EXPECT_EQ(one.out.v, chunked.out.v);
    EXPECT_EQ(one.lse, chunked.lse);
    EXPECT_EQ(one.lse_proxy, chunked.lse_proxy);
    EXPECT_EQ(std::memcmp(&one.kl, &chunked.kl, sizeof(float)), 0)
        << one.kl << " vs " << chunked.kl;
  }
}

using CudaForwardKl = CudaTest;

// Without kl: no workspace is needed, the other outputs are unchanged, and kl is untouched.
TEST_F(CudaForwardKl, NullKlSkipsThePass) {
  Config cfg;
  cfg.d = {.B = 1, .S = 333, .H = 8, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 64, .Dp = 64, .K = 2};
  cfg.dtype = DType::kBFloat16;
  const Inputs in = random_inputs(cfg.d, 77, cfg.dtype);
  const Config ref_cfg = cpu_config(cfg);
  const std::vector<int32_t> indices = run_select(ref_cfg, in);
  const Outputs want = run_forward(ref_cfg, in, false, indices, false);
  const CudaOutputs got = run_cuda_forward(cfg, in, false, indices, false);
  expect_match(got, want, cfg.dtype, false);
}

// kl is reduced in a fixed order: repeated runs give the same bits.
TEST_F(CudaForwardKl, Deterministic) {
  Config cfg;
  cfg.d = {.B = 2, .S = 900, .H = 16, .Hk = 4, .Hp = 4, .Hpk = 1, .D = 64, .Dp = 64, .K = 3};
  cfg.dtype = DType::kBFloat16;
  const Inputs in = random_inputs(cfg.d, 99, cfg.dtype);
  const std::vector<int32_t> indices = run_select(cpu_config(cfg), in);
  const float a = run_cuda_forward(cfg, in, false, indices).kl;
  const float b = run_cuda_forward(cfg, in, false, indices).kl;
  EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << a << " vs " << b;
}

using CudaForwardIndices = CudaTest;

// Out-of-range and future index entries are skipped, never read through.
TEST_F(CudaForwardIndices, InvalidEntriesSkipped) {
  Config cfg;
  cfg.d = {.B = 1, .S = 512, .H = 4, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 64, .Dp = 64, .K = 4};
  cfg.dtype = DType::kBFloat16;
  const Inputs in = random_inputs(cfg.d, 5, cfg.dtype);
  std::vector<int32_t> clean(cfg.index_count()), dirty(cfg.index_count());
  for (int64_t i = 0; i < cfg.d.S; ++i) {
    const int32_t own = static_cast<int32_t>(i / kBlockSize);
    // Clean: the own block, then -1. Dirty: garbage around the own block that must be ignored
    // (negative, far past NB, a future block, and a duplicate of the own block).
    const int32_t c[4] = {own, -1, -1, -1};
    const int32_t g[4] = {-5, own, own, own + 1 < 4 ? own + 1 : 1 << 30};
    for (int x = 0; x < 4; ++x) {
      clean[static_cast<size_t>(i * 4 + x)] = c[x];
      dirty[static_cast<size_t>(i * 4 + x)] = g[x];
    }
  }
  const Outputs want = run_forward(cpu_config(cfg), in, false, clean);
  const CudaOutputs got = run_cuda_forward(cfg, in, false, dirty);
  expect_match(got, want, cfg.dtype, true);
}

// ---- the tile path (Hopper, Dp = 128, without the KL value) ----

// The in-row position of each flattened token's document start.
std::vector<int32_t> doc_starts(const Config& cfg) {
  std::vector<int32_t> start(static_cast<size_t>(cfg.d.B * cfg.d.S), 0);
  for (int64_t t = 0; t < cfg.d.B * cfg.d.S; ++t) {
    const int64_t row = t / cfg.d.S * cfg.d.S;
    int64_t at = row;
    for (const int32_t cut : cfg.cu_seqlens)
      if (cut <= t) at = std::max<int64_t>(at, cut);
    start[static_cast<size_t>(t)] = static_cast<int32_t>(at - row);
  }
  return start;
}

// Selections made per 128-query block for about half of the blocks (chosen at random): every
// query of block n selects n and up to K - 1 random earlier blocks that all of them see; the
// other blocks keep the per-token selections `per_token`.
std::vector<int32_t> per_block_indices(const Config& cfg, std::vector<int32_t> indices,
                                       uint32_t seed) {
  const Dims& d = cfg.d;
  const std::vector<int32_t> start = doc_starts(cfg);
  std::mt19937 rng(seed);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t p = 0; p < d.Hp; ++p)
      for (int64_t n = 0; n < d.NB(); ++n) {
        if (rng() % 2) continue;
        const int64_t lo = n * kBlockSize, hi = std::min(d.S, lo + kBlockSize);
        int32_t first = 0;  // the first block that every query of the block sees
        for (int64_t i = lo; i < hi; ++i)
          first = std::max(first, start[static_cast<size_t>(b * d.S + i)] / int32_t(kBlockSize));
        std::vector<int32_t> pool;
        for (int32_t m = first; m < n; ++m) pool.push_back(m);
        std::shuffle(pool.begin(), pool.end(), rng);
        pool.resize(std::min<size_t>(pool.size(), static_cast<size_t>(d.K - 1)));
        pool.push_back(static_cast<int32_t>(n));
        std::sort(pool.begin(), pool.end());
        pool.resize(static_cast<size_t>(d.K), -1);
        for (int64_t i = lo; i < hi; ++i)
          std::copy(pool.begin(), pool.end(), indices.begin() + ((b * d.Hp + p) * d.S + i) * d.K);
      }
  return indices;
}

// Whether each query row (b, p, i) lies in a tile whose queries all have the same index row (for
// valid selections: the same valid blocks, the tile path's rule).
std::vector<bool> listed_rows(const Config& cfg, const std::vector<int32_t>& indices) {
  const Dims& d = cfg.d;
  std::vector<bool> listed(static_cast<size_t>(d.B * d.Hp * d.S));
  for (int64_t bp = 0; bp < d.B * d.Hp; ++bp)
    for (int64_t n = 0; n < d.NB(); ++n) {
      const int64_t lo = n * kBlockSize, hi = std::min(d.S, lo + kBlockSize);
      const auto row = [&](int64_t i) { return indices.begin() + (bp * d.S + i) * d.K; };
      bool same = true;
      for (int64_t i = lo + 1; i < hi && same; ++i)
        same = std::equal(row(i), row(i) + d.K, row(lo));
      for (int64_t i = lo; i < hi; ++i) listed[static_cast<size_t>(bp * d.S + i)] = same;
    }
  return listed;
}

using CudaForwardTiles = CudaTestWithParam<ShapeCase>;

// Tiles of per-block selections among per-token ones, against the CPU backend. On Hopper the
// listed tiles run query-outer: the rows of the other tiles keep the bits of the key-outer path
// (which a call with the KL value takes for every row), and the listed rows' lse differ from it
// by rounding (an online softmax instead of a merge of per-block partials), which shows that the
// path ran. Chunks leave the bits unchanged, and so does a second call.
TEST_P(CudaForwardTiles, MatchesCpu) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype == DType::kBFloat16 ? "bf16" : "fp16");
    const Config cfg = case_config(GetParam(), dtype);
    const Dims& d = cfg.d;
    const Inputs in = random_inputs(d, 321, dtype);
    const Config ref_cfg = cpu_config(cfg);
    const std::vector<int32_t> indices = per_block_indices(cfg, run_select(ref_cfg, in), 17);
    const CudaOutputs got = run_cuda_forward(cfg, in, false, indices, false);
    expect_match(got, run_forward(ref_cfg, in, false, indices, false), dtype, false);
    const CudaOutputs again = run_cuda_forward(cfg, in, false, indices, false);
    EXPECT_EQ(got.out.v, again.out.v);
    EXPECT_EQ(got.lse, again.lse);
    EXPECT_EQ(got.lse_proxy, again.lse_proxy);
    const CudaOutputs chunked = run_cuda_forward(cfg, in, false, indices, false, kBlockSize);
    EXPECT_EQ(got.out.v, chunked.out.v);
    EXPECT_EQ(got.lse, chunked.lse);
    EXPECT_EQ(got.lse_proxy, chunked.lse_proxy);
    if (cuda::sparse_kernels(cfg.problem()) != cuda::Kernels::kHopper) continue;

    const CudaOutputs key_outer = run_cuda_forward(cfg, in, false, indices, true);
    const std::vector<bool> listed = listed_rows(cfg, indices);
    const int64_t G = d.H / d.Hp;
    int64_t listed_count = 0, listed_differ = 0, other_differ = 0;
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.H; ++h)
        for (int64_t i = 0; i < d.S; ++i) {
          const size_t row = static_cast<size_t>((b * d.H + h) * d.S + i);
          const bool in_tile = listed[static_cast<size_t>((b * d.Hp + h / G) * d.S + i)];
          const bool differ =
              std::memcmp(&got.lse[row], &key_outer.lse[row], sizeof(float)) != 0 ||
              !std::equal(got.out.v.begin() + static_cast<int64_t>(row) * d.D,
                          got.out.v.begin() + static_cast<int64_t>(row + 1) * d.D,
                          key_outer.out.v.begin() + static_cast<int64_t>(row) * d.D);
          listed_count += in_tile;
          (in_tile ? listed_differ : other_differ) += differ;
        }
    EXPECT_GT(listed_count, 0) << "no tile of per-block selections";
    EXPECT_LT(listed_count, d.B * d.H * d.S) << "no tile of per-token selections";
    EXPECT_GT(listed_differ, 0) << "the listed rows took the key-outer path";
    EXPECT_EQ(other_differ, 0) << "rows outside the listed tiles changed";
    std::printf("[ tiles ] %lld of %lld rows listed, %lld of them with other bits than key-outer\n",
                (long long)listed_count, (long long)(d.B * d.H * d.S), (long long)listed_differ);
  }
}

// Ragged S (a partial last tile), packed documents that cut tiles (those take the per-token
// path where their queries see different blocks), K above the blocks of the first tiles, G in
// {1, 4, 64}, several proxy heads per kv head and per proxy key head, token-major views.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaForwardTiles,
    ::testing::Values(
        ShapeCase{
            "B2_S1100_G4_Hp4_docs",
            {.B = 2, .S = 1100, .H = 16, .Hk = 4, .Hp = 4, .Hpk = 1, .D = 128, .Dp = 128, .K = 4},
            {300, 301, 1500}},
        ShapeCase{
            "S700_G64_token_major",
            {.B = 1, .S = 700, .H = 64, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 128, .Dp = 128, .K = 3},
            {},
            Layout::kTokenMajor},
        ShapeCase{
            "S900_G1_Hpk2_K5",
            {.B = 1, .S = 900, .H = 4, .Hk = 2, .Hp = 4, .Hpk = 2, .D = 128, .Dp = 128, .K = 5}}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- golden cases (float64 reference on bf16-representable inputs) ----

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

double meta_number(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\"");
  if (at == std::string::npos) return 0;
  return std::stod(json.substr(json.find(':', at) + 1));
}

using CudaForwardGolden = CudaTest;

TEST_F(CudaForwardGolden, AllCases) {
  if (golden_case_names().empty()) GTEST_SKIP() << golden_missing_reason();
  const std::string root = golden_dir().string();
  int ran = 0;
  for (const char* name :
       {"case_basic", "case_dp_ne_d", "case_few_blocks", "case_head_dim_128", "case_own_block_only",
        "case_paper_heads", "case_ragged", "case_varlen", "case_warmup"}) {
    const std::string dir = root + "/" + name + "/";
    const std::string meta = read_text(dir + "meta.json");
    if (meta.empty()) continue;
    SCOPED_TRACE(name);
    ++ran;
    const bool warmup = meta.find("\"warmup\"") != std::string::npos;
    Config cfg;
    cfg.d = {.B = int64_t(meta_number(meta, "B")),
             .S = int64_t(meta_number(meta, "S")),
             .H = int64_t(meta_number(meta, "H")),
             .Hk = int64_t(meta_number(meta, "Hk")),
             .Hp = int64_t(meta_number(meta, "Hp")),
             .Hpk = int64_t(meta_number(meta, "Hpk")),
             .D = int64_t(meta_number(meta, "D")),
             .Dp = int64_t(meta_number(meta, "Dp")),
             .K = std::max<int64_t>(1, int64_t(meta_number(meta, "top_k_blocks")))};
    cfg.dtype = DType::kBFloat16;
    cfg.scale = float(meta_number(meta, "scale"));
    cfg.proxy_scale = float(meta_number(meta, "proxy_scale"));
    if (meta.find("\"varlen\": true") != std::string::npos)
      cfg.cu_seqlens = read_npy<int32_t>(dir + "cu_seqlens.npy").data;
    const Dims& d = cfg.d;
    Inputs in;
    in.qp = Tensor(d.B, d.Hp, d.S, d.Dp);
    in.kp = Tensor(d.B, d.Hpk, d.S, d.Dp);
    in.q = Tensor(d.B, d.H, d.S, d.D);
    in.k = Tensor(d.B, d.Hk, d.S, d.D);
    in.v = Tensor(d.B, d.Hk, d.S, d.D);
    in.qp.v = read_npy<float>(dir + "qp.npy").data;
    in.kp.v = read_npy<float>(dir + "kp.npy").data;
    in.q.v = read_npy<float>(dir + "q.npy").data;
    in.k.v = read_npy<float>(dir + "k.npy").data;
    in.v.v = read_npy<float>(dir + "v.npy").data;
    const std::vector<int32_t> indices =
        warmup ? std::vector<int32_t>() : read_npy<int32_t>(dir + "indices.npy").data;
    const std::vector<float> out = read_npy<float>(dir + "out.npy").data;
    const std::vector<float> lse = read_npy<float>(dir + "lse.npy").data;
    const CudaOutputs got = run_cuda_forward(cfg, in, warmup, indices);
    const double out_err = rel_l2(got.out.v, out);
    EXPECT_LT(out_err, 1e-2) << "out vs golden: relative L2";
    EXPECT_CLOSE(got.lse, lse, 1e-5, 1e-3);
    const double kl = meta_number(meta, "kl");
    EXPECT_NEAR(got.kl, kl, 2e-3 * std::fabs(kl) + 1e-5) << "kl vs golden";
    std::printf("[ golden ] %s: out rel L2 %.2e, kl %.6f (golden %.6f)\n", name, out_err, got.kl,
                kl);
  }
  EXPECT_GT(ran, 0) << "no golden cases under " << root;
}

// ---- the backend's own limits ----

using CudaForwardLimits = CudaTest;

TEST_F(CudaForwardLimits, RejectedWithNamedArgument) {
  Config cfg;
  cfg.d = {.B = 1, .S = 256, .H = 4, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 64, .Dp = 64, .K = 2};
  cfg.dtype = DType::kBFloat16;
  DeviceMemory buf(size_t(1) << 22), lse(4096), ws(4096);
  auto params_for = [&](const Config& c) {
    ForwardParams p;
    p.problem = c.problem();
    p.indices = static_cast<const int32_t*>(buf.get());
    const int64_t dd = c.d.D, dp = c.d.Dp, s = c.d.S;
    p.qp = {buf.get(), c.d.Hp * s * dp, s * dp, dp};
    p.kp = {buf.get(), c.d.Hpk * s * dp, s * dp, dp};
    p.q = {buf.get(), c.d.H * s * dd, s * dd, dd};
    p.k = {buf.get(), c.d.Hk * s * dd, s * dd, dd};
    p.v = {buf.get(), c.d.Hk * s * dd, s * dd, dd};
    p.out = {buf.get(), c.d.H * s * dd, s * dd, dd};
    p.lse = static_cast<float*>(lse.get());
    p.lse_proxy = static_cast<float*>(lse.get());
    p.kl = static_cast<float*>(lse.get());
    return p;
  };
  const cuda::Workspace big{ws.get(), ws.bytes()};
  {
    Config c = cfg;  // G = 128: beyond the sparse kernels' 64; G = 32 (D = 64): the portable
                     // warmup kernels' 16
    c.d.H = 128;
    c.d.Hk = 1;
    EXPECT_MSA_ERROR(cuda::sparse_forward(params_for(c), big, nullptr), "heads");
    c.d.H = 32;
    EXPECT_MSA_ERROR(cuda::warmup_forward(params_for(c), big, nullptr), "heads");
  }
  {
    Config c = cfg;  // D = Dp = 128: the Hopper warmup kernels take G <= 64, and the forward
                     // asked for the KL value G <= 16 (its second walk runs on the portable
                     // kernels)
    c.d.D = c.d.Dp = 128;
    c.d.H = 128;
    c.d.Hk = 1;
    EXPECT_MSA_ERROR(cuda::warmup_forward(params_for(c), big, nullptr), "heads");
    c.d.H = 32;
    EXPECT_MSA_ERROR(cuda::warmup_forward(params_for(c), big, nullptr), "heads");
  }
  {
    Config c = cfg;
    c.d.K = 65;
    EXPECT_MSA_ERROR(cuda::sparse_forward(params_for(c), big, nullptr), "top_k");
  }
  {
    Config c = cfg;
    c.d.D = 96;
    EXPECT_MSA_ERROR(cuda::sparse_forward(params_for(c), big, nullptr), "head_dim");
  }
  {
    Config c = cfg;
    c.d.H = 4;
    c.d.Hk = 2;
    c.d.Hp = 1;
    EXPECT_MSA_ERROR(cuda::warmup_forward(params_for(c), big, nullptr), "proxy_heads");
  }
  {
    ForwardParams p = params_for(cfg);
    p.q.stride_s = 68;
    EXPECT_MSA_ERROR(cuda::sparse_forward(p, big, nullptr), "q");
  }
  {
    ForwardParams p = params_for(cfg);
    p.out.data = static_cast<char*>(buf.get()) + 4;
    EXPECT_MSA_ERROR(cuda::sparse_forward(p, big, nullptr), "out");
  }
  {
    Config c = cfg;
    c.dtype = DType::kFloat32;
    EXPECT_MSA_ERROR(cuda::sparse_forward(params_for(c), big, nullptr), "dtype");
  }
  EXPECT_MSA_ERROR(cuda::sparse_forward(params_for(cfg), {ws.get(), 16}, nullptr), "workspace");
}

// ---- timing at the paper shape (run with --gtest_also_run_disabled_tests) ----

using CudaForwardPerf = CudaTest;

TEST_F(CudaForwardPerf, DISABLED_PaperShape) {
  const int64_t S = 32768, H = 64, Hk = 4, Hp = 4, D = 128, K = 16;
  Config cfg;
  cfg.d = {.B = 1, .S = S, .H = H, .Hk = Hk, .Hp = Hp, .Hpk = 1, .D = D, .Dp = D, .K = K};
  cfg.dtype = DType::kBFloat16;
  // Each query: its own block plus 15 random distinct earlier blocks (all of them if fewer),
  // ascending, then -1; drawn per query (per_block false) or once per 128-query block and
  // proxy head (true: the tile path's selections, FlexAttention's block mask).
  std::mt19937 rng(7);
  double attended = 0;  // keys attended per (query, proxy head), summed
  auto draw = [&](bool per_block) {
    std::vector<int32_t> indices(static_cast<size_t>(Hp * S * K), -1);
    std::vector<int32_t> pool, sel;
    attended = 0;
    for (int64_t p = 0; p < Hp; ++p)
      for (int64_t i = 0; i < S; ++i) {
        const int32_t own = static_cast<int32_t>(i / kBlockSize);
        const int32_t take = std::min<int32_t>(own, static_cast<int32_t>(K - 1));
        if (!per_block || i % kBlockSize == 0) {
          pool.resize(static_cast<size_t>(own));
          for (int32_t n = 0; n < own; ++n) pool[static_cast<size_t>(n)] = n;
          for (int32_t x = 0; x < take; ++x)
            std::swap(pool[static_cast<size_t>(x)],
                      pool[static_cast<size_t>(x + rng() % static_cast<uint32_t>(own - x))]);
          sel.assign(pool.begin(), pool.begin() + take);
          sel.push_back(own);
          std::sort(sel.begin(), sel.end());
        }
        std::copy(sel.begin(), sel.end(), indices.begin() + (p * S + i) * K);
        attended += double(take) * kBlockSize + double(i % kBlockSize + 1);
      }
    return indices;
  };
  const std::vector<int32_t> indices = draw(false), blocked = draw(true);
  const size_t q_bytes = size_t(H * S * D) * 2, kv_bytes = size_t(Hk * S * D) * 2;
  DeviceMemory dq(q_bytes), dk(kv_bytes), dv(kv_bytes), dout(q_bytes);
  DeviceMemory dqp(size_t(Hp * S * D) * 2), dkp(size_t(S * D) * 2);
  DeviceMemory didx(indices.data(), indices.size() * sizeof(int32_t));
  DeviceMemory dblocked(blocked.data(), blocked.size() * sizeof(int32_t));
  DeviceMemory dlse(size_t(H * S) * 4), dlsep(size_t(Hp * S) * 4), dkl(4);
  // Random bf16 bits in a safe range: sign, exponent 125..127, random mantissa (|x| in [0.25, 2)),
  // a 1M-element random pattern repeated.
  std::vector<uint16_t> host(q_bytes / 2);
  const size_t period = size_t(1) << 20;
  for (size_t x = 0; x < period; ++x)
    host[x] = static_cast<uint16_t>((rng() & 0x807f) | ((125 + rng() % 3) << 7));
  for (size_t x = period; x < host.size(); ++x) host[x] = host[x - period + 7];
  for (DeviceMemory* m : {&dq, &dout})
    cudaMemcpy(m->get(), host.data(), q_bytes, cudaMemcpyHostToDevice);
  for (DeviceMemory* m : {&dk, &dv, &dkp})
    cudaMemcpy(m->get(), host.data(), m->bytes(), cudaMemcpyHostToDevice);
  cudaMemcpy(dqp.get(), host.data() + 12345, dqp.bytes(), cudaMemcpyHostToDevice);
  ForwardParams params;
  params.problem = cfg.problem();
  params.indices = static_cast<const int32_t*>(didx.get());
  params.qp = contiguous_view<const void>(dqp.get(), Hp, S, D);
  params.kp = contiguous_view<const void>(dkp.get(), 1, S, D);
  params.q = contiguous_view<const void>(dq.get(), H, S, D);
  params.k = contiguous_view<const void>(dk.get(), Hk, S, D);
  params.v = contiguous_view<const void>(dv.get(), Hk, S, D);
  params.out = contiguous_view<void>(dout.get(), H, S, D);
  params.lse = static_cast<float*>(dlse.get());
  params.lse_proxy = static_cast<float*>(dlsep.get());
  DeviceMemory ws(cuda::forward_workspace_bytes(params, false));
  const double flops = 4.0 * double(H / Hp) * double(D) * attended;  // 4*H*D*sum keys
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (const auto& [per_block, with_kl] : {std::pair{false, false}, std::pair{false, true},
                                           std::pair{true, false}, std::pair{true, true}}) {
    params.indices = static_cast<const int32_t*>(per_block ? dblocked.get() : didx.get());
    params.kl = with_kl ? static_cast<float*>(dkl.get()) : nullptr;
    std::vector<float> ms;
    for (int rep = 0; rep < 12; ++rep) {
      cudaEventRecord(start);
      cuda::sparse_forward(params, {ws.get(), ws.bytes()}, nullptr);
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      float t = 0;
      cudaEventElapsedTime(&t, start, stop);
      if (rep >= 2) ms.push_back(t);
    }
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    std::sort(ms.begin(), ms.end());
    const float median = ms[ms.size() / 2];
    std::printf(
        "[ perf ] sparse_forward S=%lld H=%lld D=%lld K=%lld bf16 %s kl=%s: %.3f ms, "
        "%.1f TFLOP/s (4*H*D*keys)\n",
        (long long)S, (long long)H, (long long)D, (long long)K,
        per_block ? "per-block selections" : "per-token selections", with_kl ? "on" : "off", median,
        flops / (median * 1e-3) / 1e12);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace flash_msa::test
