// CUDA proxy select (SPEC section 1) against float64 block scores and the CPU backend: format
// (ascending, -1 padding, own block), top-K by score, ties, packed documents, strided views,
// golden cases, the backend's argument limits, the FP8 select (its quantisation, ranking and
// errors), and (disabled by default) the paper-shape timing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/golden.h"
#include "common/problem.h"
#include "common/reference.h"
#include "cuda/cuda_test_util.h"
#include "cuda/host/plan.h"
#include "cuda/select/sm90/select_sm90.h"
#include "flash_msa/cuda.h"

namespace flash_msa::test {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

ConstView device_view(const DeviceMemory& mem, const Packed& p) {
  return {mem.get(), p.stride_b, p.stride_h, p.stride_s};
}

// Runs cuda::select with poisoned indices; fails the test if any entry is left unwritten.
std::vector<int32_t> run_cuda_select(const Config& cfg, const Inputs& in,
                                     SelectPrecision precision = SelectPrecision::kExact) {
  const Packed qp = pack(in.qp, cfg.dtype, cfg.layout);
  const Packed kp = pack(in.kp, cfg.dtype, cfg.layout);
  DeviceMemory dqp(qp.bits.data(), qp.bits.size() * 2);
  DeviceMemory dkp(kp.bits.data(), kp.bits.size() * 2);
  DeviceMemory dcu(cfg.cu_seqlens.data(), cfg.cu_seqlens.size() * sizeof(int32_t));
  std::vector<int32_t> indices(cfg.index_count(), kIndexPoison);
  DeviceMemory didx(indices.data(), indices.size() * sizeof(int32_t));
  Problem pr = cfg.problem();
  pr.cu_seqlens = cfg.cu_seqlens.empty() ? nullptr : static_cast<const int32_t*>(dcu.get());
  const SelectParams params{pr, device_view(dqp, qp), device_view(dkp, kp),
                            static_cast<int32_t*>(didx.get()), precision};
  DeviceMemory ws(cuda::select_workspace_bytes(params));
  cuda::select(params, {ws.get(), ws.bytes()}, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(indices.data(), didx.get(), didx.bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int64_t unwritten = 0;
  for (int32_t x : indices) unwritten += x == kIndexPoison;
  EXPECT_EQ(unwritten, 0) << "indices: entries left unwritten";
  return indices;
}

int64_t differing_rows(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t k) {
  int64_t n = 0;
  for (size_t r = 0; r * k < a.size(); ++r)
    n += !std::equal(a.begin() + r * k, a.begin() + (r + 1) * k, b.begin() + r * k);
  return n;
}

// The select shapes: lengths that are no multiple of 128, K above the visible blocks, B > 1,
// packed documents, token-major views, K = 64; Dp = 64 and 128 take the Hopper kernel on an
// H100/H200, Dp = 32 the portable one.
std::vector<ShapeCase> select_shapes() {
  return {
      ShapeCase{"S1000_Dp128_K4",
                {.B = 1, .S = 1000, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 128, .K = 4},
                {}},
      ShapeCase{"B2_S700_Dp64_Hpk2_K3_token_major",
                {.B = 2, .S = 700, .H = 4, .Hk = 2, .Hp = 4, .Hpk = 2, .D = 8, .Dp = 64, .K = 3},
                {},
                Layout::kTokenMajor},
      ShapeCase{"K_gt_blocks_Dp32",
                {.B = 2, .S = 300, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 32, .K = 5},
                {}},
      ShapeCase{"S1_B3",
                {.B = 3, .S = 1, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 64, .K = 2},
                {}},
      ShapeCase{"S256_K1",
                {.B = 1, .S = 256, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 128, .K = 1},
                {}},
      ShapeCase{"varlen_straddling",
                {.B = 2, .S = 600, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 128, .K = 2},
                {130, 300, 301, 700, 1000}},
      ShapeCase{"varlen_K_gt_visible",
                {.B = 1, .S = 640, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 64, .K = 4},
                {200, 390, 600}},
      ShapeCase{"varlen_many_docs_token_major",
                {.B = 2, .S = 2000, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 128, .K = 8},
                {37, 500, 1290, 2400, 3333, 3334, 3900},
                Layout::kTokenMajor},
      ShapeCase{"K64_S8242_Dp32",
                {.B = 1, .S = 8242, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 32, .K = 64},
                {}},
      ShapeCase{"K64_S8242_Dp128",
                {.B = 1, .S = 8242, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 128, .K = 64},
                {}},
      ShapeCase{"K64_B2_S2500_Dp64",
                {.B = 2, .S = 2500, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 64, .K = 64},
                {}},
      ShapeCase{"paper_heads_S4096_K16",
                {.B = 1, .S = 4096, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = 128, .K = 16},
                {}}};
}

// The selection of `sc` against float64 block scores and the CPU backend.
void check_select(const ShapeCase& sc, DType dtype) {
  const Config cfg = case_config(sc, dtype);
  const Inputs in = random_inputs(cfg.d, 7 + static_cast<uint32_t>(sc.d.S * sc.d.K), dtype);
  const std::vector<int32_t> gpu = run_cuda_select(cfg, in);
  // Products of 16-bit inputs are exact in fp32; the two fp32 sums (tensor cores, CPU) differ
  // from float64 by ~Dp ulp of |score| <= ~5, i.e. < 1e-4. 1e-3 only excuses near-ties.
  std::string first;
  EXPECT_EQ(selection_errors(cfg, in, gpu, 1e-3, &first), 0) << first;
  Config host = cfg;
  host.layout = Layout::kContiguous;
  const std::vector<int32_t> cpu = run_select(host, in);
  const int64_t rows = cfg.d.B * cfg.d.Hp * cfg.d.S;
  const int64_t diff = differing_rows(gpu, cpu, cfg.d.K);
  EXPECT_LE(diff, rows / 100) << "rows whose selection differs from the CPU backend";
  std::printf("[ select ] %s %s %s: %lld of %lld rows differ from cpu::select\n", sc.name,
              dtype_name(dtype), cuda::kernels_name(cuda::select_kernels(cfg.problem())),
              static_cast<long long>(diff), static_cast<long long>(rows));
}

class CudaSelect : public CudaTestWithParam<std::tuple<ShapeCase, DType>> {};

TEST_P(CudaSelect, TopKByScoreMatchesCpu) {
  const auto& [sc, dtype] = GetParam();
  check_select(sc, dtype);
}

INSTANTIATE_TEST_SUITE_P(CudaSelectShapes, CudaSelect,
                         ::testing::Combine(::testing::ValuesIn(select_shapes()),
                                            ::testing::Values(DType::kBFloat16, DType::kFloat16)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

// On an H100/H200 the Dp = 64 and 128 shapes take the Hopper kernel; here every shape takes the
// portable one, the path of sm_80 and sm_100a.
using CudaSelectPortable = CudaTest;

TEST_F(CudaSelectPortable, ShapesMatchCpu) {
  const PortableKernels portable;
  for (const ShapeCase& sc : select_shapes()) {
    SCOPED_TRACE(sc.name);
    check_select(sc, DType::kBFloat16);
  }
}

// A shard of the queries (Problem::query_offset, query_len; the qp view starts at the shard)
// selects exactly the rows of the whole call, for shards that start inside a block and pair
// the Hopper kernel's tiles differently from the whole call, with packed documents.
using CudaSelectShard = CudaTest;

// The FP8 select on a device that runs it: compute capability 9.x with sm_90a code.
bool fp8_select_runs() {
  Problem pr;
  pr.proxy_head_dim = 128;
  return cuda::select_kernels(pr) == cuda::Kernels::kHopper;
}

// cuda::select on the shard of `sq` queries from position `q0` (the qp view starting there):
// the shard's indices, [B, Hp, sq, K].
std::vector<int32_t> run_shard(const Config& cfg, const Inputs& in, int64_t q0, int64_t sq,
                               SelectPrecision precision) {
  const Packed qp = pack(in.qp, cfg.dtype, cfg.layout);
  const Packed kp = pack(in.kp, cfg.dtype, cfg.layout);
  DeviceMemory dqp(qp.bits.data(), qp.bits.size() * 2);
  DeviceMemory dkp(kp.bits.data(), kp.bits.size() * 2);
  DeviceMemory dcu(cfg.cu_seqlens.data(), cfg.cu_seqlens.size() * sizeof(int32_t));
  Problem pr = cfg.problem();
  pr.cu_seqlens = cfg.cu_seqlens.empty() ? nullptr : static_cast<const int32_t*>(dcu.get());
  pr.query_offset = q0;
  pr.query_len = sq;
  std::vector<int32_t> got(static_cast<size_t>(cfg.d.B * cfg.d.Hp * sq * cfg.d.K), kIndexPoison);
  DeviceMemory didx(got.data(), got.size() * sizeof(int32_t));
  const ConstView shard{static_cast<const uint16_t*>(dqp.get()) + q0 * qp.stride_s, qp.stride_b,
                        qp.stride_h, qp.stride_s};
  const SelectParams params{pr, shard, device_view(dkp, kp), static_cast<int32_t*>(didx.get()),
                            precision};
  DeviceMemory ws(cuda::select_workspace_bytes(params));
  cuda::select(params, {ws.get(), ws.bytes()}, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(got.data(), didx.get(), didx.bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return got;
}

// Rows of a shard's indices that differ from the whole call's rows q0 .. q0 + sq - 1.
int64_t shard_rows_differing(const Config& cfg, const std::vector<int32_t>& shard,
                             const std::vector<int32_t>& whole, int64_t q0, int64_t sq) {
  const int64_t K = cfg.d.K, S = cfg.d.S;
  int64_t differ = 0;
  for (int64_t bh = 0; bh < cfg.d.B * cfg.d.Hp; ++bh)
    for (int64_t i = 0; i < sq; ++i)
      differ += !std::equal(shard.begin() + (bh * sq + i) * K,
                            shard.begin() + (bh * sq + i + 1) * K,
                            whole.begin() + (bh * S + q0 + i) * K);
  return differ;
}

TEST_F(CudaSelectShard, RowsEqualTheWholeCall) {
  struct Case {
    bool portable;
    int64_t dp;
    SelectPrecision precision;
  };
  std::vector<Case> cases;
  for (const bool portable : {false, true})
    for (const int64_t dp : {64, 128}) cases.push_back({portable, dp, SelectPrecision::kExact});
  if (fp8_select_runs()) cases.push_back({false, 128, SelectPrecision::kFloat8E4M3});
  for (const auto& [portable, dp, precision] : cases) {
    SCOPED_TRACE(std::string(portable ? "portable " : "default ") + std::to_string(dp) + " " +
                 select_precision_name(precision));
    std::optional<PortableKernels> forced;
    if (portable) forced.emplace();
    Config cfg;
    cfg.d = {.B = 2, .S = 1000, .H = 4, .Hk = 1, .Hp = 4, .Hpk = 2, .D = 8, .Dp = dp, .K = 4};
    cfg.dtype = DType::kBFloat16;
    cfg.cu_seqlens = {0, 300, 1000, 1450, 2000};
    const Inputs in = random_inputs(cfg.d, 11 + static_cast<uint32_t>(dp), cfg.dtype);
    const std::vector<int32_t> whole = run_cuda_select(cfg, in, precision);
    for (const auto& [q0, sq] :
         {std::pair<int64_t, int64_t>{0, 300}, {300, 256}, {556, 444}, {129, 1}, {0, 1000}}) {
      SCOPED_TRACE("shard at " + std::to_string(q0) + " of " + std::to_string(sq));
      const std::vector<int32_t> got = run_shard(cfg, in, q0, sq, precision);
      EXPECT_EQ(shard_rows_differing(cfg, got, whole, q0, sq), 0)
          << "shard rows that differ from the whole call";
    }
  }
}

// Short sequences on the Hopper kernel give fewer CTAs than the GPU holds: each CTA's walk
// over the key blocks is cut into parts that run as CTAs of their own, and the last part of a
// walk to finish picks each row's best K of the parts' lists (sm90::select_parts). The part counts follow the shape, and
// the selections equal those of whole walks bit for bit: 13 batch rows give enough CTAs for
// whole walks, row 0 alone four parts per walk, on the same inputs; with packed documents,
// K = 64 (the merge's most candidates), shards of the queries (three parts) and FP8.
using CudaSelectParts = CudaTest;

int parts_for(const Problem& pr) {
  cuda::portable::SelectKernelParams params{};
  params.shape = cuda::kernel_shape(pr);
  return cuda::sm90::select_parts(params);
}
int parts_for(const Config& cfg) { return parts_for(cfg.problem()); }

TEST_F(CudaSelectParts, CountFollowsTheShape) {
  Config cfg;  // the paper's proxy heads
  cfg.d = {.B = 1, .S = 8192, .H = 4, .Hk = 1, .Hp = 4, .Hpk = 1, .D = 8, .Dp = 128, .K = 16};
  EXPECT_EQ(parts_for(cfg), 4);
  cfg.d.S = 16384;
  EXPECT_EQ(parts_for(cfg), 2);
  cfg.d.S = 32768;
  EXPECT_EQ(parts_for(cfg), 1);
  cfg.d.S = 8192;
  cfg.d.B = 8;
  EXPECT_EQ(parts_for(cfg), 1);
  cfg.d.B = 1;
  cfg.d.S = 1000;  // walks of 8 blocks stay whole
  EXPECT_EQ(parts_for(cfg), 1);
}

TEST_F(CudaSelectParts, SelectionsEqualWholeWalks) {
  if (!fp8_select_runs()) GTEST_SKIP() << "walks are cut on the Hopper select kernel";
  struct Case {
    const char* name;
    int64_t S, Dp, K;
    std::vector<int32_t> docs;  // document starts in each batch row, then S
    SelectPrecision precision;
  };
  const Case cases[] = {
      {"S4096_K16", 4096, 128, 16, {0, 4096}, SelectPrecision::kExact},
      {"S4000_Dp64_K64_docs", 4000, 64, 64, {0, 900, 2600, 4000}, SelectPrecision::kExact},
      {"S4096_K16_docs_fp8", 4096, 128, 16, {0, 1500, 4096}, SelectPrecision::kFloat8E4M3}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Config many;
    many.d = {.B = 13, .S = c.S, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 8, .Dp = c.Dp, .K = c.K};
    many.dtype = DType::kBFloat16;
    Config one = many;
    one.d.B = 1;
    for (int64_t b = 0; b < many.d.B; ++b)
      for (size_t x = b == 0 ? 0 : 1; x < c.docs.size(); ++x)
        many.cu_seqlens.push_back(static_cast<int32_t>(b * c.S + c.docs[x]));
    one.cu_seqlens = c.docs;
    ASSERT_EQ(parts_for(many), 1);
    ASSERT_EQ(parts_for(one), 4);
    const Inputs in = random_inputs(many.d, 23 + static_cast<uint32_t>(c.K), many.dtype);
    Inputs row0;
    for (const auto& [from, to] : {std::pair{&in.qp, &row0.qp}, {&in.kp, &row0.kp}}) {
      *to = Tensor(1, from->n1, from->n2, from->n3);
      std::copy(from->v.begin(), from->v.begin() + to->v.size(), to->v.begin());
    }
    const std::vector<int32_t> whole = run_cuda_select(many, in, c.precision);
    const std::vector<int32_t> cut = run_cuda_select(one, row0, c.precision);
    EXPECT_TRUE(std::equal(cut.begin(), cut.end(), whole.begin()))
        << "row 0's indices with cut walks differ from those with whole walks";
    std::string first;
    if (c.precision == SelectPrecision::kExact) {
      EXPECT_EQ(selection_errors(one, row0, cut, 1e-3, &first), 0) << first;
    }
    const int64_t q0 = 1000, sq = 2000;
    Problem shard = one.problem();
    shard.query_offset = q0;
    shard.query_len = sq;
    ASSERT_EQ(parts_for(shard), 3);
    const std::vector<int32_t> got = run_shard(one, row0, q0, sq, c.precision);
    EXPECT_EQ(shard_rows_differing(one, got, cut, q0, sq), 0)
        << "shard rows (three parts per walk) that differ from the whole call";
  }
}

// ---- the FP8 select (SelectPrecision::kFloat8E4M3: Hopper kernel, Dp = 128) ----

using CudaSelectFp8 = CudaTest;

// The quantisation writes the E4M3 code nearest to x / scale (ties to even, saturated) and
// scale = amax / 448 per row, bit for bit as the brute-force reference, with zeros past the
// tokens: rows of magnitudes 2^-12 .. 2^7, a row of zeros, a row that reaches the subnormal
// codes, and values on the midpoints between codes.
template <class T>
void check_quantisation(DType dtype) {
  constexpr int64_t kDp = 128, heads = 3, tokens = 50, padded = 64;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(heads * tokens * kDp));
  for (int64_t r = 0; r < heads * tokens; ++r) {
    float* row = &x[static_cast<size_t>(r * kDp)];
    for (int64_t c = 0; c < kDp; ++c)
      row[c] = round_to(dtype, normal(rng) * std::ldexp(1.f, static_cast<int>(r % 20) - 12));
  }
  std::fill(x.begin() + 7 * kDp, x.begin() + 8 * kDp, 0.f);  // a row of zeros
  x[9 * kDp] = 448.f;  // scale 1: the rest lands on the small and subnormal codes
  for (int64_t c = 1; c < kDp; ++c) x[static_cast<size_t>(9 * kDp + c)] *= 1e-2f;
  x[10 * kDp] = -448.f;  // scale 1 again: midpoints between codes, and the smallest code
  const float mids[] = {1.0625f, 0.0009765625f, 0.0029296875f, -1.1875f, 432.f, 0.001953125f};
  for (int c = 0; c < 6; ++c) x[static_cast<size_t>(10 * kDp + 1 + c)] = mids[c];
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    bits[i] = dtype == DType::kBFloat16 ? host::float_to_bf16(x[i]) : host::float_to_fp16(x[i]);
  DeviceMemory in(bits.data(), bits.size() * 2);
  std::vector<uint8_t> out(static_cast<size_t>(heads * padded * kDp), 0xAB);
  std::vector<float> scales(static_cast<size_t>(heads * padded), kNaN);
  DeviceMemory dout(out.data(), out.size()), dscales(scales.data(), scales.size() * 4);
  cuda::sm90::launch_quantize<T>({.in = contiguous_view<const void>(in.get(), heads, tokens, kDp),
                                  .out = static_cast<uint8_t*>(dout.get()),
                                  .scales = static_cast<float*>(dscales.get()),
                                  .rows = heads * padded,
                                  .heads = static_cast<int>(heads),
                                  .tokens = static_cast<int>(tokens),
                                  .padded = static_cast<int>(padded)},
                                 nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(out.data(), dout.get(), out.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(scales.data(), dscales.get(), scales.size() * 4, cudaMemcpyDeviceToHost));
  int64_t bad_codes = 0, bad_scales = 0;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < padded; ++s) {
      const int64_t r = h * padded + s;
      const float* row = &x[static_cast<size_t>((h * tokens + s) * kDp)];
      const float scale = s < tokens ? e4m3_scale_of(row, kDp) : 1.f;
      bad_scales += scales[static_cast<size_t>(r)] != scale;
      for (int64_t c = 0; c < kDp; ++c) {
        const uint8_t want = s < tokens ? nearest_e4m3(row[c] / scale) : 0;
        bad_codes += out[static_cast<size_t>(r * kDp + c)] != want;
      }
    }
  EXPECT_EQ(bad_codes, 0) << "E4M3 codes that differ from the nearest";
  EXPECT_EQ(bad_scales, 0) << "row scales that differ from amax / 448";
}

TEST_F(CudaSelectFp8, QuantisationIsNearestE4M3) {
  if (!fp8_select_runs()) GTEST_SKIP() << "the FP8 select needs the Hopper select kernel";
  check_quantisation<__nv_bfloat16>(DType::kBFloat16);
  check_quantisation<__half>(DType::kFloat16);
}

// Over the Dp = 128 select shapes, keys of magnitudes 2^-3 .. 2^3: the selection is a top-K
// of the float64 scores of the dequantised proxies, and agrees with the CPU backend's FP8
// select.
TEST_F(CudaSelectFp8, TopKOfTheQuantisedScores) {
  if (!fp8_select_runs()) GTEST_SKIP() << "the FP8 select needs the Hopper select kernel";
  for (const ShapeCase& sc : select_shapes()) {
    if (sc.d.Dp != 128) continue;
    for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(std::string(sc.name) + " " + dtype_name(dtype));
      const Config cfg = case_config(sc, dtype);
      Inputs in = random_inputs(cfg.d, 9 + static_cast<uint32_t>(sc.d.S), dtype);
      for (size_t x = 0; x < in.kp.v.size(); ++x)
        in.kp.v[x] = round_to(dtype, in.kp.v[x] * std::ldexp(1.f, int(x / 128 % 7) - 3));
      const std::vector<int32_t> gpu = run_cuda_select(cfg, in, SelectPrecision::kFloat8E4M3);
      // The scores' fp32 sums (FP8 tensor cores, float64) differ by far less than 1e-2 of
      // scores of magnitude ~1 .. 40, the FP8 rounding itself by ~5e-2 of the row's spread.
      std::string first;
      EXPECT_EQ(selection_errors(cfg, fp8_inputs(in), gpu, 1e-2, &first), 0) << first;
      Config host = cfg;
      host.layout = Layout::kContiguous;
      const std::vector<int32_t> cpu = run_select(host, in, SelectPrecision::kFloat8E4M3);
      const int64_t rows = cfg.d.B * cfg.d.Hp * cfg.d.S;
      const int64_t diff = differing_rows(gpu, cpu, cfg.d.K);
      EXPECT_LE(diff, rows / 100) << "rows whose selection differs from the CPU FP8 select";
      std::printf("[ select fp8 ] %s %s: %lld of %lld rows differ from cpu::select (fp8)\n",
                  sc.name, dtype_name(dtype), static_cast<long long>(diff),
                  static_cast<long long>(rows));
    }
  }
}

// Errors: a proxy head dim without the path, a device or build without the Hopper kernel (or
// the portable kernels forced), a workspace too small, a precision out of the enum.
TEST_F(CudaSelectFp8, RejectedWithNamedArgument) {
  Config cfg;
  cfg.d = {.B = 1, .S = 256, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 128, .K = 2};
  cfg.dtype = DType::kBFloat16;
  DeviceMemory qp(size_t(cfg.d.S * 128 * 2)), kp(size_t(cfg.d.S * 128 * 2));
  DeviceMemory idx(cfg.index_count() * 4);
  auto params = [&](const Config& c, SelectPrecision precision) {
    return SelectParams{c.problem(), contiguous_view<const void>(qp.get(), c.d.Hp, c.d.S, c.d.Dp),
                        contiguous_view<const void>(kp.get(), c.d.Hpk, c.d.S, c.d.Dp),
                        static_cast<int32_t*>(idx.get()), precision};
  };
  const SelectParams fp8 = params(cfg, SelectPrecision::kFloat8E4M3);
  DeviceMemory ws(cuda::select_workspace_bytes(fp8));
  EXPECT_GT(ws.bytes(), 0u);
  EXPECT_MSA_ERROR(cuda::select(params(cfg, static_cast<SelectPrecision>(7)), {}, nullptr),
                   "precision");
  if (!fp8_select_runs()) {
    EXPECT_MSA_ERROR(cuda::select(fp8, {ws.get(), ws.bytes()}, nullptr), "precision");
    return;
  }
  Config c = cfg;
  c.d.Dp = 64;
  EXPECT_MSA_ERROR(
      cuda::select(params(c, SelectPrecision::kFloat8E4M3), {ws.get(), ws.bytes()}, nullptr),
      "proxy_head_dim");
  EXPECT_MSA_ERROR(cuda::select(fp8, {ws.get(), ws.bytes() - 256}, nullptr), "workspace");
  {
    const PortableKernels forced;
    EXPECT_MSA_ERROR(cuda::select(fp8, {ws.get(), ws.bytes()}, nullptr), "precision");
  }
  cuda::select(fp8, {ws.get(), ws.bytes()}, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
}

using CudaSelectTies = CudaTest;

// Exact ties (identical keys, small-integer values: every dot product is exact in any order):
// the lower block index wins.
TEST_F(CudaSelectTies, LowerBlockWins) {
  Config cfg;
  cfg.d = {.B = 1, .S = 1000, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 64, .K = 3};
  cfg.dtype = DType::kBFloat16;
  Inputs in = random_inputs(cfg.d, 3, cfg.dtype);
  for (float& x : in.qp.v) x = std::round(x);
  for (int64_t j = 0; j < cfg.d.S; ++j)
    for (int64_t c = 0; c < cfg.d.Dp; ++c) in.kp.at(0, 0, j, c) = float(c % 3) - 1.f;
  const std::vector<int32_t> idx = run_cuda_select(cfg, in);
  for (int64_t i = 0; i < cfg.d.S; ++i) {
    const int32_t own = static_cast<int32_t>(i / kBlockSize);
    std::vector<int32_t> want;
    for (int32_t n = 0; n < own && static_cast<int64_t>(want.size()) < cfg.d.K - 1; ++n)
      want.push_back(n);
    want.push_back(own);
    while (static_cast<int64_t>(want.size()) < cfg.d.K) want.push_back(-1);
    const std::vector<int32_t> got(idx.begin() + i * cfg.d.K, idx.begin() + (i + 1) * cfg.d.K);
    ASSERT_EQ(got, want) << "query " << i;
  }
}

// ---- golden cases (float64, independent reference) ----

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

double meta_number(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\"");
  if (at == std::string::npos) return 0;
  return std::strtod(json.c_str() + json.find(':', at) + 1, nullptr);
}

// Reads a little-endian C-order .npy of float32 or int32 (format version 1 or 2).
template <class T>
std::vector<T> read_npy(const std::string& path) {
  const std::string raw = read_text(path);
  if (raw.size() < 10 || raw.compare(1, 5, "NUMPY") != 0) return {};
  const bool v1 = raw[6] == 1;
  const size_t header_len = v1 ? (uint8_t(raw[8]) | uint8_t(raw[9]) << 8)
                               : (uint8_t(raw[8]) | uint8_t(raw[9]) << 8 | uint8_t(raw[10]) << 16 |
                                  size_t(uint8_t(raw[11])) << 24);
  const size_t start = (v1 ? 10 : 12) + header_len;
  std::vector<T> v((raw.size() - start) / sizeof(T));
  std::memcpy(v.data(), raw.data() + start, v.size() * sizeof(T));
  return v;
}

using CudaSelectGolden = CudaTest;

TEST_F(CudaSelectGolden, AllSparseCases) {
  if (golden_case_names().empty()) GTEST_SKIP() << golden_missing_reason();
  const std::string root = golden_dir().string();
  int ran = 0;
  for (const char* name :
       {"case_basic", "case_dp_ne_d", "case_few_blocks", "case_head_dim_128", "case_own_block_only",
        "case_paper_heads", "case_ragged", "case_varlen"}) {
    const std::string dir = root + "/" + name + "/";
    const std::string meta = read_text(dir + "meta.json");
    if (meta.empty() || meta.find("\"sparse\"") == std::string::npos) continue;
    SCOPED_TRACE(name);
    ++ran;
    Config cfg;
    cfg.d = {.B = int64_t(meta_number(meta, "B")),
             .S = int64_t(meta_number(meta, "S")),
             .H = int64_t(meta_number(meta, "H")),
             .Hk = int64_t(meta_number(meta, "Hk")),
             .Hp = int64_t(meta_number(meta, "Hp")),
             .Hpk = int64_t(meta_number(meta, "Hpk")),
             .D = int64_t(meta_number(meta, "D")),
             .Dp = int64_t(meta_number(meta, "Dp")),
             .K = int64_t(meta_number(meta, "top_k_blocks"))};
    cfg.dtype = DType::kBFloat16;
    cfg.scale = float(meta_number(meta, "scale"));
    cfg.proxy_scale = float(meta_number(meta, "proxy_scale"));
    if (meta.find("\"varlen\": true") != std::string::npos)
      cfg.cu_seqlens = read_npy<int32_t>(dir + "cu_seqlens.npy");
    const Dims& d = cfg.d;
    Inputs in;
    in.qp = Tensor(d.B, d.Hp, d.S, d.Dp);
    in.kp = Tensor(d.B, d.Hpk, d.S, d.Dp);
    in.qp.v = read_npy<float>(dir + "qp.npy");
    in.kp.v = read_npy<float>(dir + "kp.npy");
    ASSERT_EQ(in.qp.v.size(), size_t(d.B * d.Hp * d.S * d.Dp));
    ASSERT_EQ(in.kp.v.size(), size_t(d.B * d.Hpk * d.S * d.Dp));
    const std::vector<int32_t> want = read_npy<int32_t>(dir + "indices.npy");
    const std::vector<float> scores = read_npy<float>(dir + "block_scores.npy");
    ASSERT_EQ(want.size(), cfg.index_count());
    ASSERT_EQ(scores.size(), size_t(d.B * d.Hp * d.S * d.NB()));
    const std::vector<int32_t> got = run_cuda_select(cfg, in);
    // By score against the golden float64 block scores (stored as float32: ~1e-7 relative).
    int64_t bad = 0;
    for (size_t r = 0; r * d.K < got.size(); ++r) {
      const float* s = &scores[r * d.NB()];
      std::vector<char> sel(static_cast<size_t>(d.NB()), 0);
      int64_t valid = 0, visible = 0;
      for (int64_t n = 0; n < d.NB(); ++n) visible += s[n] > -INFINITY;
      bool ok = true;
      for (int64_t x = 0; x < d.K; ++x) {
        const int32_t e = got[r * d.K + x];
        if (e == -1) continue;
        ok &= e >= 0 && e < d.NB() &&
              (x == 0 || (got[r * d.K + x - 1] != -1 && got[r * d.K + x - 1] < e));
        if (!ok) break;
        sel[e] = 1;
        ++valid;
      }
      float worst = INFINITY, best_out = -INFINITY;
      for (int64_t n = 0; n < d.NB(); ++n) {
        if (sel[n]) {
          worst = std::min(worst, s[n]);
        } else {
          best_out = std::max(best_out, s[n]);
        }
      }
      ok = ok && valid == std::min<int64_t>(d.K, visible) && worst >= best_out - 1e-3f &&
           worst > -INFINITY;
      bad += !ok;
    }
    EXPECT_EQ(bad, 0) << "rows failing the by-score check";
    const int64_t diff = differing_rows(got, want, d.K);
    EXPECT_LE(diff, int64_t(got.size() / d.K) / 100) << "rows differing from golden indices";
    std::printf("[ golden ] %s: %lld rows differ from the golden indices\n", name,
                static_cast<long long>(diff));
  }
  EXPECT_GT(ran, 0) << "no golden sparse cases under " << root;
}

// ---- the backend's own limits ----

using CudaSelectLimits = CudaTest;

TEST_F(CudaSelectLimits, RejectedWithNamedArgument) {
  Config cfg;
  cfg.d = {.B = 1, .S = 256, .H = 1, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 8, .Dp = 64, .K = 2};
  cfg.dtype = DType::kBFloat16;
  DeviceMemory qp(size_t(4 * cfg.d.S * 128 * 4)), kp(size_t(4 * cfg.d.S * 128 * 4));
  DeviceMemory idx(cfg.index_count() * 4 * 64);
  auto params = [&](const Config& c) {
    return SelectParams{c.problem(), contiguous_view<const void>(qp.get(), c.d.Hp, c.d.S, c.d.Dp),
                        contiguous_view<const void>(kp.get(), c.d.Hpk, c.d.S, c.d.Dp),
                        static_cast<int32_t*>(idx.get())};
  };
  Config c = cfg;
  c.dtype = DType::kFloat32;
  EXPECT_MSA_ERROR(cuda::select(params(c), {}, nullptr), "dtype");
  c = cfg;
  c.d.Dp = 48;
  EXPECT_MSA_ERROR(cuda::select(params(c), {}, nullptr), "proxy_head_dim");
  c = cfg;
  c.d.K = 65;
  EXPECT_MSA_ERROR(cuda::select(params(c), {}, nullptr), "top_k");
  SelectParams p = params(cfg);
  p.qp.data = static_cast<const char*>(qp.get()) + 2;
  EXPECT_MSA_ERROR(cuda::select(p, {}, nullptr), "qp");
  p = params(cfg);
  p.kp.stride_s = cfg.d.Dp + 4;
  EXPECT_MSA_ERROR(cuda::select(p, {}, nullptr), "kp");
}

// ---- timing at the paper's proxy shape (run with --gtest_also_run_disabled_tests; with
// FLASH_MSA_PORTABLE_KERNELS=1 for the portable kernel), exact and, where it runs, FP8 with
// its overlap with the exact selection ----

using CudaSelectPerf = CudaTest;

TEST_F(CudaSelectPerf, DISABLED_PaperShape) {
  for (const auto& [S, K] : {std::pair<int64_t, int64_t>{8192, 16},
                             {32768, 16},
                             {131072, 16},
                             {1048576, 16},
                             {32768, 64}}) {
    Config cfg;
    cfg.d = {.B = 1, .S = S, .H = 64, .Hk = 4, .Hp = 4, .Hpk = 1, .D = 128, .Dp = 128, .K = K};
    cfg.dtype = DType::kBFloat16;
    const Dims& d = cfg.d;
    std::vector<uint16_t> host(static_cast<size_t>((d.Hp + d.Hpk) * S * d.Dp));
    uint32_t state = 12345u;
    for (uint16_t& x : host) {
      state = state * 1664525u + 1013904223u;
      x = float_to_bf16(float(int32_t(state >> 8) % 4001 - 2000) / 1000.f);
    }
    DeviceMemory qp(host.data(), size_t(d.Hp * S * d.Dp * 2));
    DeviceMemory kp(host.data() + d.Hp * S * d.Dp, size_t(d.Hpk * S * d.Dp * 2));
    DeviceMemory idx(cfg.index_count() * 4);
    std::vector<int32_t> exact;
    for (const SelectPrecision precision :
         {SelectPrecision::kExact, SelectPrecision::kFloat8E4M3}) {
      if (precision == SelectPrecision::kFloat8E4M3 && !fp8_select_runs()) continue;
      CUDA_OK(cudaMemset(idx.get(), 0x80, idx.bytes()));
      const SelectParams params{cfg.problem(), contiguous_view<const void>(qp.get(), d.Hp, S, d.Dp),
                                contiguous_view<const void>(kp.get(), d.Hpk, S, d.Dp),
                                static_cast<int32_t*>(idx.get()), precision};
      DeviceMemory ws(cuda::select_workspace_bytes(params));
      const cuda::Workspace workspace{ws.get(), ws.bytes()};
      cudaEvent_t start, stop;
      CUDA_OK(cudaEventCreate(&start));
      CUDA_OK(cudaEventCreate(&stop));
      const int iterations = S >= 524288 ? 3 : 10;
      for (int w = 0; w < 2; ++w) cuda::select(params, workspace, nullptr);
      std::vector<float> ms;
      for (int it = 0; it < iterations; ++it) {
        CUDA_OK(cudaEventRecord(start));
        cuda::select(params, workspace, nullptr);
        CUDA_OK(cudaEventRecord(stop));
        CUDA_OK(cudaEventSynchronize(stop));
        float t = 0;
        CUDA_OK(cudaEventElapsedTime(&t, start, stop));
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double flops = 2.0 * d.Hp * d.Dp * double(S) * double(S) / 2;
      std::vector<int32_t> out(cfg.index_count());
      CUDA_OK(cudaMemcpy(out.data(), idx.get(), idx.bytes(), cudaMemcpyDeviceToHost));
      int64_t bad = 0, shared = 0, chosen = 0;
      for (int64_t r = 0; r < d.Hp * S; ++r) {
        const int32_t own = static_cast<int32_t>((r % S) / kBlockSize);
        const int32_t* row = &out[static_cast<size_t>(r * d.K)];
        bad += std::find(row, row + d.K, own) == row + d.K;
        if (exact.empty() || own < d.K - 1) continue;  // overlap over rows with a choice to make
        const int32_t* want = &exact[static_cast<size_t>(r * d.K)];
        for (int64_t x = 0; x < d.K; ++x)
          if (row[x] != own) shared += std::find(want, want + d.K, row[x]) != want + d.K;
        chosen += d.K - 1;
      }
      EXPECT_EQ(bad, 0) << "rows without their own block";
      std::printf(
          "[ perf ] select (%s, %s) B=1 Hp=4 Hpk=1 Dp=128 bf16 K=%lld S=%lld: median %.3f ms "
          "(min %.3f), %.1f TFLOP/s",
          cuda::kernels_name(cuda::select_kernels(params.problem)),
          select_precision_name(precision), static_cast<long long>(K), static_cast<long long>(S),
          ms[ms.size() / 2], ms[0], flops / (ms[ms.size() / 2] * 1e-3) / 1e12);
      if (chosen > 0) std::printf(", overlap with exact %.4f", double(shared) / double(chosen));
      std::printf("\n");
      if (exact.empty()) exact = std::move(out);
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
  }
}

}  // namespace
}  // namespace flash_msa::test
