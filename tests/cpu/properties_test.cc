// Properties of the math that hold exactly or nearly exactly (SPEC sections 2-5): causality,
// document isolation, KL >= 0 and = 0 for a matching proxy, the split of gradients between the
// main and proxy branches, warmup == sparse with every block selected, layouts and dtypes.
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "common/problem.h"
#include "common/reference.h"

namespace flash_msa::test {
namespace {

std::vector<int32_t> maybe_select(const Config& cfg, const Inputs& in, bool warmup) {
  return warmup ? std::vector<int32_t>{} : run_select(cfg, in);
}

std::string mode_name(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "warmup" : "sparse";
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (float x : t.v) m = std::max(m, double(std::fabs(x)));
  return m;
}

// Every element of rows (b, h, s) with keep(b, s) is bitwise equal in a and b.
template <class Keep>
int64_t rows_differing(const Tensor& a, const Tensor& b, Keep keep) {
  int64_t n = 0;
  for (int64_t x = 0; x < a.n0; ++x)
    for (int64_t h = 0; h < a.n1; ++h)
      for (int64_t s = 0; s < a.n2; ++s) {
        if (!keep(x, s)) continue;
        for (int64_t c = 0; c < a.n3; ++c)
          if (!(a.at(x, h, s, c) == b.at(x, h, s, c))) {
            ++n;
            break;
          }
      }
  return n;
}

// Same for [B, heads, S] (or [B, heads, S, K] with k > 1) flat vectors.
template <class T, class Keep>
int64_t rows_differing(const std::vector<T>& a, const std::vector<T>& b, int64_t batch,
                       int64_t heads, int64_t seqlen, int64_t k, Keep keep) {
  int64_t n = 0;
  for (int64_t x = 0; x < batch; ++x)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t s = 0; s < seqlen; ++s) {
        if (!keep(x, s)) continue;
        for (int64_t c = 0; c < k; ++c) {
          const size_t i = static_cast<size_t>(((x * heads + h) * seqlen + s) * k + c);
          if (!(a[i] == b[i])) {
            ++n;
            break;
          }
        }
      }
  return n;
}

class ModeTest : public ::testing::TestWithParam<bool> {};

// ---- causality ----

TEST_P(ModeTest, FutureKeysDoNotChangePastOutputs) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 2, .S = 300, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 16, .K = 2};
  const Inputs a = random_inputs(cfg.d, 11);
  Inputs b = a;
  const int64_t cut = 170;  // keys at positions >= cut change: queries < cut must not notice
  std::mt19937 rng(12);
  std::normal_distribution<float> normal;
  for (Tensor* t : {&b.k, &b.v, &b.kp})
    for (int64_t x = 0; x < t->n0; ++x)
      for (int64_t h = 0; h < t->n1; ++h)
        for (int64_t s = cut; s < t->n2; ++s)
          for (int64_t c = 0; c < t->n3; ++c) t->at(x, h, s, c) = 3.f * normal(rng);
  const auto past = [&](int64_t, int64_t s) { return s < cut; };
  const auto future = [&](int64_t, int64_t s) { return s >= cut; };
  const std::vector<int32_t> ia = maybe_select(cfg, a, warmup);
  const std::vector<int32_t> ib = maybe_select(cfg, b, warmup);
  const Dims& d = cfg.d;
  if (!warmup) {
    EXPECT_EQ(rows_differing(ia, ib, d.B, d.Hp, d.S, d.K, past), 0);
  }
  // Feed each run its own indices (identical for past queries, as just checked).
  const Outputs oa = run_forward(cfg, a, warmup, ia);
  const Outputs ob = run_forward(cfg, b, warmup, ib);
  EXPECT_EQ(rows_differing(oa.out, ob.out, past), 0);
  EXPECT_EQ(rows_differing(oa.lse, ob.lse, d.B, d.H, d.S, 1, past), 0);
  EXPECT_EQ(rows_differing(oa.lse_proxy, ob.lse_proxy, d.B, d.Hp, d.S, 1, past), 0);
  // Non-vacuous: the changed keys are seen by later queries.
  EXPECT_GT(rows_differing(oa.out, ob.out, future), 0);
}

// ---- documents ----

struct DocSetup {
  Config cfg;
  Inputs a, b;  // b differs from a in every input and dout of the tokens of document `doc`
  std::vector<int32_t> doc_of;
  int32_t doc = 1;
};

DocSetup doc_setup() {
  DocSetup ds;
  ds.cfg.d = {.B = 2, .S = 260, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 2};
  // Documents [0,100) [100,260) | [260,390) [390,400) [400,520): document 1 fills the rest of
  // row 0 and shares block 0 with document 0.
  ds.cfg.cu_seqlens = make_cu_seqlens(ds.cfg.d, {100, 390, 400});
  ds.doc_of = doc_ids(ds.cfg);
  ds.a = random_inputs(ds.cfg.d, 21);
  ds.b = ds.a;
  std::mt19937 rng(22);
  std::normal_distribution<float> normal;
  for (Tensor* t : {&ds.b.qp, &ds.b.kp, &ds.b.q, &ds.b.k, &ds.b.v, &ds.b.dout})
    for (int64_t x = 0; x < t->n0; ++x)
      for (int64_t h = 0; h < t->n1; ++h)
        for (int64_t s = 0; s < t->n2; ++s)
          if (ds.doc_of[x * ds.cfg.d.S + s] == ds.doc)
            for (int64_t c = 0; c < t->n3; ++c) t->at(x, h, s, c) = 2.f * normal(rng);
  return ds;
}

TEST_P(ModeTest, OtherDocumentsDoNotChangeOutputsOrGradients) {
  const bool warmup = GetParam();
  const DocSetup ds = doc_setup();
  const Config& cfg = ds.cfg;
  const Dims& d = cfg.d;
  const auto other = [&](int64_t x, int64_t s) { return ds.doc_of[x * d.S + s] != ds.doc; };
  const auto inside = [&](int64_t x, int64_t s) { return ds.doc_of[x * d.S + s] == ds.doc; };
  const std::vector<int32_t> ia = maybe_select(cfg, ds.a, warmup);
  const std::vector<int32_t> ib = maybe_select(cfg, ds.b, warmup);
  if (!warmup) {
    EXPECT_EQ(rows_differing(ia, ib, d.B, d.Hp, d.S, d.K, other), 0);
  }
  const Outputs oa = run_forward(cfg, ds.a, warmup, ia);
  const Outputs ob = run_forward(cfg, ds.b, warmup, ib);
  EXPECT_EQ(rows_differing(oa.out, ob.out, other), 0);
  EXPECT_EQ(rows_differing(oa.lse, ob.lse, d.B, d.H, d.S, 1, other), 0);
  EXPECT_EQ(rows_differing(oa.lse_proxy, ob.lse_proxy, d.B, d.Hp, d.S, 1, other), 0);
  EXPECT_GT(rows_differing(oa.out, ob.out, inside), 0);

  // Gradients of other documents' tokens are unchanged too; for dqp/dkp because the KL's per-row
  // terms do not mix documents and its normalisation 1/(B*Hp*S) is a constant.
  const float w = 0.7f;
  const Grads ga = run_backward(cfg, ds.a, oa, warmup, ia, &w);
  const Grads gb = run_backward(cfg, ds.b, ob, warmup, ib, &w);
  EXPECT_EQ(rows_differing(ga.dq, gb.dq, other), 0);
  EXPECT_EQ(rows_differing(ga.dk, gb.dk, other), 0);
  EXPECT_EQ(rows_differing(ga.dv, gb.dv, other), 0);
  EXPECT_EQ(rows_differing(ga.dqp, gb.dqp, other), 0);
  EXPECT_EQ(rows_differing(ga.dkp, gb.dkp, other), 0);
  EXPECT_GT(rows_differing(ga.dk, gb.dk, inside), 0);
}

// With the upstream gradient nonzero only on document 1's queries and w = 0, every key outside
// document 1 gets exactly zero dk and dv (it is used only by queries of its own document), and
// every query outside it zero dq, while document 1's keys get nonzero gradients.
TEST_P(ModeTest, KeysOnlyGetGradientsFromTheirDocument) {
  const bool warmup = GetParam();
  DocSetup ds = doc_setup();
  const Config& cfg = ds.cfg;
  const Dims& d = cfg.d;
  Inputs in = ds.a;
  for (int64_t x = 0; x < d.B; ++x)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t s = 0; s < d.S; ++s)
        if (ds.doc_of[x * d.S + s] != ds.doc)
          for (int64_t c = 0; c < d.D; ++c) in.dout.at(x, h, s, c) = 0.f;
  const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
  const Outputs o = run_forward(cfg, in, warmup, idx);
  const Grads g = run_backward(cfg, in, o, warmup, idx, nullptr);
  for (const Tensor* t : {&g.dq, &g.dk, &g.dv}) {
    int64_t nonzero_outside = 0, nonzero_inside = 0;
    for (int64_t x = 0; x < t->n0; ++x)
      for (int64_t h = 0; h < t->n1; ++h)
        for (int64_t s = 0; s < t->n2; ++s)
          for (int64_t c = 0; c < t->n3; ++c) {
            const bool in_doc = ds.doc_of[x * d.S + s] == ds.doc;
            (in_doc ? nonzero_inside : nonzero_outside) += t->at(x, h, s, c) != 0.f;
          }
    EXPECT_EQ(nonzero_outside, 0);
    EXPECT_GT(nonzero_inside, 0);
  }
}

// ---- KL ----

TEST_P(ModeTest, KlIsNonNegativeAndMatchesReference) {
  const bool warmup = GetParam();
  for (const Dims& dims :
       {Dims{.B = 2, .S = 300, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 2},
        Dims{.B = 1, .S = 200, .H = 8, .Hk = 2, .Hp = 2, .Hpk = 2, .D = 8, .Dp = 16, .K = 1}}) {
    Config cfg;
    cfg.d = dims;
    const Inputs in = random_inputs(cfg.d, 31 + static_cast<uint32_t>(dims.H));
    const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
    const Outputs o = run_forward(cfg, in, warmup, idx);
    const RefForward r = ref_forward(cfg, in, warmup, idx);
    EXPECT_GT(o.kl, 0.f);
    EXPECT_NEAR(o.kl, r.kl, 1e-5 * r.kl + 1e-7);
  }
}

// Student == teacher: G = 1, Hk = Hpk, qp = q, kp = k, Dp = D, proxy_scale = scale.
TEST_P(ModeTest, KlVanishesWhenProxyMatchesTeacher) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 2, .S = 300, .H = 2, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 16, .K = 2};
  cfg.scale = cfg.proxy_scale = 0.3f;
  Inputs in = random_inputs(cfg.d, 41);
  const Inputs unmatched = in;
  in.qp = in.q;
  in.kp = in.k;
  const float w = 1.f;
  const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
  const Outputs o = run_forward(cfg, in, warmup, idx);
  const Grads g = run_backward(cfg, in, o, warmup, idx, &w);
  // Reference magnitudes from the unmatched proxy of the same shapes.
  const std::vector<int32_t> idx_u = maybe_select(cfg, unmatched, warmup);
  const Outputs ou = run_forward(cfg, unmatched, warmup, idx_u);
  const Grads gu = run_backward(cfg, unmatched, ou, warmup, idx_u, &w);
  ASSERT_GT(ou.kl, 1e-2f);
  EXPECT_NEAR(o.kl, 0.f, 1e-5f) << "unmatched kl " << ou.kl;
  EXPECT_LE(max_abs(g.dqp), 1e-3 * max_abs(gu.dqp));
  EXPECT_LE(max_abs(g.dkp), 1e-3 * max_abs(gu.dkp));
  EXPECT_GT(max_abs(gu.dqp), 0.0);
  EXPECT_GT(max_abs(gu.dkp), 0.0);
}

// ---- the two branches of the backward ----

TEST_P(ModeTest, MainGradientsIgnoreKlGradAndProxyGradientsAreLinearInIt) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 1, .S = 300, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 2};
  const Inputs in = random_inputs(cfg.d, 51);
  const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
  const Outputs o = run_forward(cfg, in, warmup, idx);
  const float w1 = 0.7f, w2 = 1.4f, w3 = -0.35f;
  const Grads g0 = run_backward(cfg, in, o, warmup, idx, nullptr);
  const Grads g1 = run_backward(cfg, in, o, warmup, idx, &w1);
  const Grads g2 = run_backward(cfg, in, o, warmup, idx, &w2);
  const Grads g3 = run_backward(cfg, in, o, warmup, idx, &w3);
  for (const Grads* g : {&g1, &g2, &g3}) {
    EXPECT_EQ(g->dq.v, g0.dq.v);
    EXPECT_EQ(g->dk.v, g0.dk.v);
    EXPECT_EQ(g->dv.v, g0.dv.v);
  }
  EXPECT_EQ(max_abs(g0.dqp), 0.0);
  EXPECT_EQ(max_abs(g0.dkp), 0.0);
  ASSERT_GT(max_abs(g1.dqp), 0.0);
  ASSERT_GT(max_abs(g1.dkp), 0.0);
  ASSERT_GT(max_abs(g0.dq), 0.0);
  auto scaled = [](const Tensor& t, float f) {
    std::vector<float> r = t.v;
    for (float& x : r) x *= f;
    return r;
  };
  EXPECT_CLOSE(g2.dqp.v, scaled(g1.dqp, 2.f), 1e-5, 0.0);
  EXPECT_CLOSE(g2.dkp.v, scaled(g1.dkp, 2.f), 1e-5, 0.0);
  EXPECT_CLOSE(g3.dqp.v, scaled(g1.dqp, -0.5f), 1e-5, 0.0);
  EXPECT_CLOSE(g3.dkp.v, scaled(g1.dkp, -0.5f), 1e-5, 0.0);
}

// Every backend is deterministic (msa.h): the same call twice gives the same bits.
TEST_P(ModeTest, RunsAreBitwiseReproducible) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 2, .S = 260, .H = 4, .Hk = 1, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 2};
  const Inputs in = random_inputs(cfg.d, 61);
  const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
  const Outputs o1 = run_forward(cfg, in, warmup, idx);
  const Outputs o2 = run_forward(cfg, in, warmup, idx);
  EXPECT_EQ(o1.out.v, o2.out.v);
  EXPECT_EQ(o1.lse, o2.lse);
  EXPECT_EQ(o1.lse_proxy, o2.lse_proxy);
  EXPECT_EQ(o1.kl, o2.kl);
  const float w = 0.7f;
  const Grads g1 = run_backward(cfg, in, o1, warmup, idx, &w);
  const Grads g2 = run_backward(cfg, in, o1, warmup, idx, &w);
  EXPECT_EQ(g1.dq.v, g2.dq.v);
  EXPECT_EQ(g1.dk.v, g2.dk.v);
  EXPECT_EQ(g1.dv.v, g2.dv.v);
  EXPECT_EQ(g1.dqp.v, g2.dqp.v);
  EXPECT_EQ(g1.dkp.v, g2.dkp.v);
}

// Forward values and the selection do not depend on the thread count (every row is computed on
// its own and kl is summed in row order); the backward's cross-row sums may be reassociated.
TEST_P(ModeTest, ThreadCountDoesNotChangeResults) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 2, .S = 300, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 2};
  const Inputs in = random_inputs(cfg.d, 63);
  const float w = 0.7f;
  cpu::set_num_threads(1);
  const std::vector<int32_t> i1 = maybe_select(cfg, in, warmup);
  const Outputs o1 = run_forward(cfg, in, warmup, i1);
  const Grads g1 = run_backward(cfg, in, o1, warmup, i1, &w);
  cpu::set_num_threads(3);
  const std::vector<int32_t> i3 = maybe_select(cfg, in, warmup);
  const Outputs o3 = run_forward(cfg, in, warmup, i3);
  const Grads g3 = run_backward(cfg, in, o1, warmup, i1, &w);
  cpu::set_num_threads(0);
  EXPECT_EQ(i1, i3);
  EXPECT_EQ(o1.out.v, o3.out.v);
  EXPECT_EQ(o1.lse, o3.lse);
  EXPECT_EQ(o1.lse_proxy, o3.lse_proxy);
  EXPECT_EQ(o1.kl, o3.kl);
  EXPECT_CLOSE(g3.dq.v, g1.dq.v, 1e-5, 1e-7);
  EXPECT_CLOSE(g3.dk.v, g1.dk.v, 1e-5, 1e-7);
  EXPECT_CLOSE(g3.dv.v, g1.dv.v, 1e-5, 1e-7);
  EXPECT_CLOSE(g3.dqp.v, g1.dqp.v, 1e-5, 1e-9);
  EXPECT_CLOSE(g3.dkp.v, g1.dkp.v, 1e-5, 1e-9);
}

// kl is optional: leaving it null changes nothing else.
TEST_P(ModeTest, KlPointerIsOptional) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 1, .S = 200, .H = 2, .Hk = 1, .Hp = 1, .Hpk = 1, .D = 16, .Dp = 8, .K = 1};
  const Inputs in = random_inputs(cfg.d, 64);
  const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
  const Outputs with = run_forward(cfg, in, warmup, idx, true);
  const Outputs without = run_forward(cfg, in, warmup, idx, false);
  EXPECT_EQ(with.out.v, without.out.v);
  EXPECT_EQ(with.lse, without.lse);
  EXPECT_EQ(with.lse_proxy, without.lse_proxy);
}

// ---- layouts and dtypes ----

TEST_P(ModeTest, TokenMajorStridedViewsMatchContiguous) {
  const bool warmup = GetParam();
  Config cfg;
  cfg.d = {.B = 2, .S = 200, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 2, .D = 16, .Dp = 8, .K = 1};
  Config strided = cfg;
  strided.layout = Layout::kTokenMajor;
  const Inputs in = random_inputs(cfg.d, 71);
  const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
  if (!warmup) {
    EXPECT_EQ(run_select(strided, in), idx);
  }
  const Outputs a = run_forward(cfg, in, warmup, idx);
  const Outputs b = run_forward(strided, in, warmup, idx);  // padding checked in run_forward
  EXPECT_CLOSE(b.out.v, a.out.v, 1e-6, 1e-7);
  EXPECT_CLOSE(b.lse, a.lse, 1e-6, 1e-7);
  EXPECT_CLOSE(b.lse_proxy, a.lse_proxy, 1e-6, 1e-7);
  EXPECT_NEAR(b.kl, a.kl, 1e-6 * a.kl);
  const float w = 0.7f;
  const Grads ga = run_backward(cfg, in, a, warmup, idx, &w);
  const Grads gb = run_backward(strided, in, a, warmup, idx, &w);
  EXPECT_CLOSE(gb.dq.v, ga.dq.v, 1e-6, 1e-8);
  EXPECT_CLOSE(gb.dk.v, ga.dk.v, 1e-6, 1e-8);
  EXPECT_CLOSE(gb.dv.v, ga.dv.v, 1e-6, 1e-8);
  EXPECT_CLOSE(gb.dqp.v, ga.dqp.v, 1e-6, 1e-10);
  EXPECT_CLOSE(gb.dkp.v, ga.dkp.v, 1e-6, 1e-10);
}

// fp16 and bf16 read the same (representable) values as the fp32 run and accumulate in fp32, so
// they differ from it by the rounding of outputs and gradients to the dtype: half an ulp, i.e.
// 2^-9 (bf16) or 2^-11 (fp16) of each value; the bounds below are 4x (bf16) and 2x (fp16) that
// of the largest value.
// Attention and gradients use the fp32 run's indices (decomposed API); the low-precision
// selection is checked by score.
struct DtypeCase {
  DType dtype;
  double rel;
};

void PrintTo(const DtypeCase& c, std::ostream* os) { *os << dtype_name(c.dtype); }

class DtypeTest : public ::testing::TestWithParam<std::tuple<DtypeCase, bool>> {};

TEST_P(DtypeTest, CloseToFloat32) {
  const auto& [dc, warmup] = GetParam();
  Config cfg;
  cfg.d = {.B = 1, .S = 300, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 32, .Dp = 16, .K = 2};
  cfg.cu_seqlens = make_cu_seqlens(cfg.d, {170});
  Config low = cfg;
  low.dtype = dc.dtype;
  const Inputs in = random_inputs(cfg.d, 81, dc.dtype);
  const std::vector<int32_t> idx = maybe_select(cfg, in, warmup);
  if (!warmup) {
    std::string first;
    EXPECT_EQ(selection_errors(low, in, run_select(low, in), 1e-4, &first), 0) << first;
  }
  const Outputs a = run_forward(cfg, in, warmup, idx);
  const Outputs b = run_forward(low, in, warmup, idx);
  EXPECT_CLOSE(b.out.v, a.out.v, dc.rel, 0.0);
  EXPECT_CLOSE(b.lse, a.lse, 1e-5, 1e-6);
  EXPECT_CLOSE(b.lse_proxy, a.lse_proxy, 1e-5, 1e-6);
  EXPECT_NEAR(b.kl, a.kl, 1e-4 * a.kl);
  const float w = 0.7f;
  const Grads ga = run_backward(cfg, in, a, warmup, idx, &w);
  const Grads gb = run_backward(low, in, b, warmup, idx, &w);
  // The backward reads the low-precision out, so Delta moves by ~one rounding of out as well.
  EXPECT_CLOSE(gb.dq.v, ga.dq.v, 2 * dc.rel, 0.0);
  EXPECT_CLOSE(gb.dk.v, ga.dk.v, 2 * dc.rel, 0.0);
  EXPECT_CLOSE(gb.dv.v, ga.dv.v, 2 * dc.rel, 0.0);
  EXPECT_CLOSE(gb.dqp.v, ga.dqp.v, 2 * dc.rel, 0.0);
  EXPECT_CLOSE(gb.dkp.v, ga.dkp.v, 2 * dc.rel, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Cpu, DtypeTest,
                         ::testing::Combine(::testing::Values(DtypeCase{DType::kBFloat16, 8e-3},
                                                              DtypeCase{DType::kFloat16, 1e-3}),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).dtype == DType::kBFloat16
                                                  ? "bf16"
                                                  : "fp16") +
                                  (std::get<1>(info.param) ? "_warmup" : "_sparse");
                         });

INSTANTIATE_TEST_SUITE_P(Cpu, ModeTest, ::testing::Bool(), mode_name);

// ---- warmup == sparse with every visible block selected ----

TEST(WarmupVsSparse, EqualWhenEveryBlockIsSelected) {
  for (int64_t extra : {0, 2}) {
    SCOPED_TRACE("K = NB + " + std::to_string(extra));
    Config cfg;
    cfg.d = {.B = 2, .S = 300, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 0};
    cfg.d.K = cfg.d.NB() + extra;
    cfg.cu_seqlens = make_cu_seqlens(cfg.d, {150, 420});
    const Inputs in = random_inputs(cfg.d, 91 + static_cast<uint32_t>(extra));
    const std::vector<int32_t> idx = run_select(cfg, in);
    const Outputs s = run_forward(cfg, in, false, idx);
    const Outputs w = run_forward(cfg, in, true, {});
    EXPECT_CLOSE(s.out.v, w.out.v, 1e-5, 1e-7);
    EXPECT_CLOSE(s.lse, w.lse, 1e-5, 1e-7);
    EXPECT_CLOSE(s.lse_proxy, w.lse_proxy, 1e-5, 1e-7);
    EXPECT_NEAR(s.kl, w.kl, 1e-5 * w.kl);
    const float kw = 0.7f;
    const Grads gs = run_backward(cfg, in, s, false, idx, &kw);
    const Grads gw = run_backward(cfg, in, w, true, {}, &kw);
    EXPECT_CLOSE(gs.dq.v, gw.dq.v, 1e-5, 1e-7);
    EXPECT_CLOSE(gs.dk.v, gw.dk.v, 1e-5, 1e-7);
    EXPECT_CLOSE(gs.dv.v, gw.dv.v, 1e-5, 1e-7);
    EXPECT_CLOSE(gs.dqp.v, gw.dqp.v, 1e-5, 1e-9);
    EXPECT_CLOSE(gs.dkp.v, gw.dkp.v, 1e-5, 1e-9);
  }
}

}  // namespace
}  // namespace flash_msa::test
