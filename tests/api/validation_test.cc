// Every documented bad input is rejected with a flash_msa::Error naming the argument, through
// each of the five entry points where the argument applies. Built into both test binaries:
// flash_msa_cpu_tests runs the CPU backend's entry points (suite Validation), and
// flash_msa_cuda_tests the CUDA backend's (suite CudaValidation), which must reject each call
// in the CPU backend's very words before touching the device (common/entry_points.h); there the
// valid calls and the checks of values read as a call runs (cu_seqlens, indices) are CPU-only.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/entry_points.h"
#include "common/expect_error.h"
#include "common/problem.h"

namespace flash_msa::test {
namespace {

enum class Op { kSelect, kSparseForward, kWarmupForward, kSparseBackward, kWarmupBackward };
const char* op_name(Op op) {
  switch (op) {
    case Op::kSelect:
      return "select";
    case Op::kSparseForward:
      return "sparse_forward";
    case Op::kWarmupForward:
      return "warmup_forward";
    case Op::kSparseBackward:
      return "sparse_backward";
    default:
      return "warmup_backward";
  }
}
constexpr Op kAllOps[] = {Op::kSelect, Op::kSparseForward, Op::kWarmupForward, Op::kSparseBackward,
                          Op::kWarmupBackward};
constexpr Op kSparseOps[] = {Op::kSelect, Op::kSparseForward, Op::kSparseBackward};

// Buffers hold 8 heads of every tensor so that mutated head counts still read inside them; the
// base problem uses B=2, S=200, H=4, Hk=2, Hp=2, Hpk=1, D=16, Dp=8, K=2.
constexpr int64_t kHeadCapacity = 8;
constexpr int64_t kBatch = 2, kSeqlen = 200;

class FLASH_MSA_VALIDATION_SUITE : public ::testing::Test {
 protected:
  FLASH_MSA_VALIDATION_SUITE()
      : qp_(make(d_.Dp, 1)),
        kp_(make(d_.Dp, 2)),
        q_(make(d_.D, 3)),
        k_(make(d_.D, 4)),
        v_(make(d_.D, 5)),
        out_(make(d_.D, 6)),
        dout_(make(d_.D, 7)),
        dqp_(make(d_.Dp, 0)),
        dkp_(make(d_.Dp, 0)),
        dq_(make(d_.D, 0)),
        dk_(make(d_.D, 0)),
        dv_(make(d_.D, 0)) {
    cfg_.d = d_;
    lse_.assign(static_cast<size_t>(d_.B * kHeadCapacity * d_.S), 0.f);
    lse_proxy_.assign(lse_.size(), 0.f);
    indices_.assign(static_cast<size_t>(d_.B * kHeadCapacity * d_.S * 8), -1);
    // A valid selection: own block, plus block 0 for queries of block 1.
    for (int64_t r = 0; r < d_.B * d_.Hp; ++r)
      for (int64_t i = 0; i < d_.S; ++i) {
        int32_t* row = &indices_[static_cast<size_t>((r * d_.S + i) * d_.K)];
        row[0] = 0;
        row[1] = i >= kBlockSize ? 1 : -1;
      }
  }

  static Buffer make(int64_t channels, uint32_t seed) {
    std::mt19937 rng(seed);
    const Tensor t = random_tensor(kBatch, kHeadCapacity, kSeqlen, channels, rng);
    return Buffer::from(t, DType::kFloat32, Layout::kContiguous);
  }

  Problem problem() const { return cfg_.problem(); }

  SelectParams select_params() { return {problem(), qp_.cview(), kp_.cview(), indices_.data()}; }

  ForwardParams forward_params(bool warmup) {
    ForwardParams p;
    p.problem = problem();
    p.indices = warmup ? nullptr : indices_.data();
    p.qp = qp_.cview();
    p.kp = kp_.cview();
    p.q = q_.cview();
    p.k = k_.cview();
    p.v = v_.cview();
    p.out = out_.mview();
    p.lse = lse_.data();
    p.lse_proxy = lse_proxy_.data();
    p.kl = &kl_;
    return p;
  }

  BackwardParams backward_params(bool warmup) {
    BackwardParams p;
    p.problem = problem();
    p.indices = warmup ? nullptr : indices_.data();
    p.qp = qp_.cview();
    p.kp = kp_.cview();
    p.q = q_.cview();
    p.k = k_.cview();
    p.v = v_.cview();
    p.out = out_.cview();
    p.dout = dout_.cview();
    p.lse = lse_.data();
    p.lse_proxy = lse_proxy_.data();
    p.kl_grad = &w_;
    p.dqp = dqp_.mview();
    p.dkp = dkp_.mview();
    p.dq = dq_.mview();
    p.dk = dk_.mview();
    p.dv = dv_.mview();
    return p;
  }

  // Runs `op` with its valid params after `mutate` edits the problem.
  void run(Op op, const std::function<void(Problem&)>& mutate) {
    switch (op) {
      case Op::kSelect: {
        SelectParams p = select_params();
        mutate(p.problem);
        entry::select(p);
        break;
      }
      case Op::kSparseForward:
      case Op::kWarmupForward: {
        const bool warmup = op == Op::kWarmupForward;
        ForwardParams p = forward_params(warmup);
        mutate(p.problem);
        entry::forward(p, warmup);
        break;
      }
      default: {
        const bool warmup = op == Op::kWarmupBackward;
        BackwardParams p = backward_params(warmup);
        mutate(p.problem);
        entry::backward(p, warmup);
        break;
      }
    }
  }

  template <class Ops>
  void expect_problem_error(const Ops& ops, const std::function<void(Problem&)>& mutate,
                            std::initializer_list<const char*> args) {
    for (Op op : ops) {
      SCOPED_TRACE(op_name(op));
      EXPECT_TRUE(throws_error_naming([&] { run(op, mutate); }, args));
    }
  }

  const Dims d_{
      .B = kBatch, .S = kSeqlen, .H = 4, .Hk = 2, .Hp = 2, .Hpk = 1, .D = 16, .Dp = 8, .K = 2};
  Config cfg_;
  Buffer qp_, kp_, q_, k_, v_, out_, dout_, dqp_, dkp_, dq_, dk_, dv_;
  std::vector<float> lse_, lse_proxy_;
  std::vector<int32_t> indices_;
  float kl_ = 0.f, w_ = 0.7f;
};

// Positive control: the base arguments are valid for every entry point, so each failure below is
// caused by its one mutation.
TEST_F(FLASH_MSA_VALIDATION_SUITE, BaseArgumentsAreAccepted) {
  FLASH_MSA_SKIP_UNLESS_RUN_ON_HOST_BUFFERS();
  for (Op op : kAllOps) {
    SCOPED_TRACE(op_name(op));
    EXPECT_MSA_OK(run(op, [](Problem&) {}));
  }
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, TopKIgnoredInWarmup) {
  FLASH_MSA_SKIP_UNLESS_RUN_ON_HOST_BUFFERS();
  for (Op op : {Op::kWarmupForward, Op::kWarmupBackward}) {
    SCOPED_TRACE(op_name(op));
    EXPECT_MSA_OK(run(op, [](Problem& p) { p.top_k = 0; }));
  }
}

// Every count and size must be positive: each field at 0 and at a negative value.
TEST_F(FLASH_MSA_VALIDATION_SUITE, NonPositiveSizes) {
  const struct {
    const char* name;
    int64_t Problem::*field;
    int64_t negative;
  } fields[] = {
      {"batch", &Problem::batch, -1},
      {"seqlen", &Problem::seqlen, -200},
      {"heads", &Problem::heads, -4},
      {"kv_heads", &Problem::kv_heads, -2},
      {"proxy_heads", &Problem::proxy_heads, -2},
      {"proxy_kv_heads", &Problem::proxy_kv_heads, -1},
      {"head_dim", &Problem::head_dim, -16},
      {"proxy_head_dim", &Problem::proxy_head_dim, -8},
  };
  for (const auto& f : fields)
    for (const int64_t value : {int64_t{0}, f.negative}) {
      SCOPED_TRACE(std::string(f.name) + " = " + std::to_string(value));
      expect_problem_error(kAllOps, [&](Problem& p) { p.*f.field = value; }, {f.name});
    }
}
TEST_F(FLASH_MSA_VALIDATION_SUITE, QueryShard) {
  // A shard of 128 queries is accepted (where no indices rows of the base selection are read).
  for (Op op : {Op::kSelect, Op::kWarmupForward, Op::kWarmupBackward}) {
    SCOPED_TRACE(op_name(op));
    if (entry::kRunsHostBuffers)
      EXPECT_MSA_OK(run(op, [](Problem& p) { p.query_len = 128, p.query_offset = 72; }));
  }
  expect_problem_error(kAllOps, [](Problem& p) { p.query_len = -1; }, {"query_len"});
  expect_problem_error(kAllOps, [](Problem& p) { p.query_offset = 5; }, {"query_offset"});
  expect_problem_error(
      kAllOps, [](Problem& p) { p.query_len = 100, p.query_offset = 101; }, {"query_offset"});
  expect_problem_error(
      kAllOps, [](Problem& p) { p.query_len = 10, p.query_offset = -1; }, {"query_offset"});
}

// The contract does not say which of the two related fields a divisibility error names.
TEST_F(FLASH_MSA_VALIDATION_SUITE, HeadsNotMultipleOfKvHeads) {
  expect_problem_error(kAllOps, [](Problem& p) { p.kv_heads = 3; }, {"heads", "kv_heads"});
}
TEST_F(FLASH_MSA_VALIDATION_SUITE, HeadsNotMultipleOfProxyHeads) {
  expect_problem_error(kAllOps, [](Problem& p) { p.proxy_heads = 3; }, {"heads", "proxy_heads"});
}
TEST_F(FLASH_MSA_VALIDATION_SUITE, ProxyHeadsNotMultipleOfProxyKvHeads) {
  expect_problem_error(kAllOps,
                       [](Problem& p) {
                         p.proxy_heads = 4;
                         p.proxy_kv_heads = 3;
                       },
                       {"proxy_heads", "proxy_kv_heads"});
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, TopK) {
  expect_problem_error(kSparseOps, [](Problem& p) { p.top_k = 0; }, {"top_k"});
  expect_problem_error(kSparseOps, [](Problem& p) { p.top_k = -1; }, {"top_k"});
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, Scale) {
  for (float bad :
       {0.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    // select does not use the main scale.
    for (Op op :
         {Op::kSparseForward, Op::kWarmupForward, Op::kSparseBackward, Op::kWarmupBackward}) {
      SCOPED_TRACE(op_name(op));
      EXPECT_TRUE(
          throws_error_naming([&] { run(op, [&](Problem& p) { p.scale = bad; }); }, {"scale"}));
    }
    expect_problem_error(kAllOps, [&](Problem& p) { p.proxy_scale = bad; }, {"proxy_scale"});
  }
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, Dtype) {
  expect_problem_error(kAllOps, [](Problem& p) { p.dtype = static_cast<DType>(4); }, {"dtype"});
  expect_problem_error(kAllOps, [](Problem& p) { p.dtype = static_cast<DType>(-1); }, {"dtype"});
}

// ---- documents ----

TEST_F(FLASH_MSA_VALIDATION_SUITE, CuSeqlensWithoutDocuments) {
  static const std::vector<int32_t> cu = {0, 200, 400};
  expect_problem_error(kAllOps,
                       [&](Problem& p) {
                         p.cu_seqlens = cu.data();
                         p.num_docs = 0;
                       },
                       {"num_docs", "cu_seqlens"});
  expect_problem_error(kAllOps,
                       [&](Problem& p) {
                         p.cu_seqlens = cu.data();
                         p.num_docs = -1;
                       },
                       {"num_docs", "cu_seqlens"});
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, CuSeqlensValues) {
  FLASH_MSA_SKIP_UNLESS_RUN_ON_HOST_BUFFERS();
  const std::vector<std::pair<const char*, std::vector<int32_t>>> bad = {
      {"first not 0", {1, 120, 200, 330, 400}},       {"last not B*S", {0, 120, 200, 330, 399}},
      {"last beyond B*S", {0, 120, 200, 330, 401}},   {"decreasing", {0, 220, 200, 330, 400}},
      {"missing the multiple S", {0, 120, 330, 400}}, {"negative", {0, -5, 200, 330, 400}},
  };
  for (const auto& [why, cu] : bad) {
    SCOPED_TRACE(why);
    expect_problem_error(kAllOps,
                         [&](Problem& p) {
                           p.cu_seqlens = cu.data();
                           p.num_docs = static_cast<int64_t>(cu.size()) - 1;
                         },
                         {"cu_seqlens"});
    EXPECT_MSA_ERROR(validate_cu_seqlens_values(
                         [&] {
                           Problem p = problem();
                           p.cu_seqlens = cu.data();
                           p.num_docs = static_cast<int64_t>(cu.size()) - 1;
                           return p;
                         }(),
                         cu.data()),
                     "cu_seqlens");
  }
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, CuSeqlensWithEmptyDocumentIsValid) {
  FLASH_MSA_SKIP_UNLESS_RUN_ON_HOST_BUFFERS();
  static const std::vector<int32_t> cu = {0, 120, 120, 200, 330, 400};
  for (Op op : kAllOps) {
    SCOPED_TRACE(op_name(op));
    EXPECT_MSA_OK(run(op, [&](Problem& p) {
      p.cu_seqlens = cu.data();
      p.num_docs = static_cast<int64_t>(cu.size()) - 1;
    }));
  }
}

// ---- user-supplied indices (sparse forward and backward) ----

TEST_F(FLASH_MSA_VALIDATION_SUITE, IndicesValues) {
  FLASH_MSA_SKIP_UNLESS_RUN_ON_HOST_BUFFERS();
  struct Bad {
    const char* why;
    int64_t query;
    std::vector<int32_t> row;  // K = 2 entries for (b 1, p 1, query)
  };
  const std::vector<Bad> bad = {
      {"beyond the last block", 150, {1, 7}},
      {"negative other than -1", 150, {-2, 1}},
      {"future block", 50, {0, 1}},
      {"duplicate", 150, {1, 1}},
      {"descending", 150, {1, 0}},
      {"-1 before a valid entry", 150, {-1, 1}},
      {"own block missing", 150, {0, -1}},
      {"own block missing, all -1", 20, {-1, -1}},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.why);
    const std::vector<int32_t> saved = indices_;
    int32_t* row = &indices_[static_cast<size_t>(((1 * d_.Hp + 1) * d_.S + b.query) * d_.K)];
    row[0] = b.row[0];
    row[1] = b.row[1];
    for (Op op : {Op::kSparseForward, Op::kSparseBackward}) {
      SCOPED_TRACE(op_name(op));
      EXPECT_TRUE(throws_error_naming([&] { run(op, [](Problem&) {}); }, {"indices"}));
    }
    EXPECT_MSA_ERROR(validate_indices_values(problem(), nullptr, indices_.data()), "indices");
    indices_ = saved;
  }
}

// ---- null pointers and strides, per tensor ----

TEST_F(FLASH_MSA_VALIDATION_SUITE, NullPointersSelect) {
  {
    SelectParams p = select_params();
    p.qp.data = nullptr;
    EXPECT_MSA_ERROR(entry::select(p), "qp");
  }
  {
    SelectParams p = select_params();
    p.kp.data = nullptr;
    EXPECT_MSA_ERROR(entry::select(p), "kp");
  }
  {
    SelectParams p = select_params();
    p.indices = nullptr;
    EXPECT_MSA_ERROR(entry::select(p), "indices");
  }
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, NullPointersForward) {
  using F = std::function<void(ForwardParams&)>;
  const std::vector<std::pair<const char*, F>> fields = {
      {"qp", [](ForwardParams& p) { p.qp.data = nullptr; }},
      {"kp", [](ForwardParams& p) { p.kp.data = nullptr; }},
      {"q", [](ForwardParams& p) { p.q.data = nullptr; }},
      {"k", [](ForwardParams& p) { p.k.data = nullptr; }},
      {"v", [](ForwardParams& p) { p.v.data = nullptr; }},
      {"out", [](ForwardParams& p) { p.out.data = nullptr; }},
      {"lse", [](ForwardParams& p) { p.lse = nullptr; }},
      {"lse_proxy", [](ForwardParams& p) { p.lse_proxy = nullptr; }},
  };
  for (bool warmup : {false, true}) {
    SCOPED_TRACE(warmup ? "warmup" : "sparse");
    for (const auto& [name, mutate] : fields) {
      SCOPED_TRACE(name);
      ForwardParams p = forward_params(warmup);
      mutate(p);
      EXPECT_TRUE(throws_error_naming(
          [&] { entry::forward(p, warmup); }, {name}));
    }
    ForwardParams p = forward_params(warmup);
    p.kl = nullptr;  // optional
    if (entry::kRunsHostBuffers) EXPECT_MSA_OK(entry::forward(p, warmup));
  }
  ForwardParams p = forward_params(false);
  p.indices = nullptr;
  EXPECT_MSA_ERROR(entry::forward(p, false), "indices");
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, NullPointersBackward) {
  using F = std::function<void(BackwardParams&)>;
  const std::vector<std::pair<const char*, F>> fields = {
      {"qp", [](BackwardParams& p) { p.qp.data = nullptr; }},
      {"kp", [](BackwardParams& p) { p.kp.data = nullptr; }},
      {"q", [](BackwardParams& p) { p.q.data = nullptr; }},
      {"k", [](BackwardParams& p) { p.k.data = nullptr; }},
      {"v", [](BackwardParams& p) { p.v.data = nullptr; }},
      {"out", [](BackwardParams& p) { p.out.data = nullptr; }},
      {"dout", [](BackwardParams& p) { p.dout.data = nullptr; }},
      {"lse", [](BackwardParams& p) { p.lse = nullptr; }},
      {"lse_proxy", [](BackwardParams& p) { p.lse_proxy = nullptr; }},
      {"dqp", [](BackwardParams& p) { p.dqp.data = nullptr; }},
      {"dkp", [](BackwardParams& p) { p.dkp.data = nullptr; }},
      {"dq", [](BackwardParams& p) { p.dq.data = nullptr; }},
      {"dk", [](BackwardParams& p) { p.dk.data = nullptr; }},
      {"dv", [](BackwardParams& p) { p.dv.data = nullptr; }},
  };
  for (bool warmup : {false, true}) {
    SCOPED_TRACE(warmup ? "warmup" : "sparse");
    for (const auto& [name, mutate] : fields) {
      SCOPED_TRACE(name);
      BackwardParams p = backward_params(warmup);
      mutate(p);
      EXPECT_TRUE(throws_error_naming(
          [&] { entry::backward(p, warmup); }, {name}));
    }
    BackwardParams p = backward_params(warmup);
    p.kl_grad = nullptr;  // optional: w = 0
    if (entry::kRunsHostBuffers) EXPECT_MSA_OK(entry::backward(p, warmup));
  }
  BackwardParams p = backward_params(false);
  p.indices = nullptr;
  EXPECT_MSA_ERROR(entry::backward(p, false), "indices");
}

// For a view, the bad strides: stride_s below the channel count (rows would overlap), and each
// stride negative.
template <class V>
std::vector<std::pair<std::string, V>> bad_strides(const V& good, int64_t channels) {
  std::vector<std::pair<std::string, V>> r;
  V v = good;
  v.stride_s = channels - 1;
  r.push_back({"stride_s < channels", v});
  v = good;
  v.stride_s = -channels;
  r.push_back({"stride_s negative", v});
  v = good;
  v.stride_h = -good.stride_h;
  r.push_back({"stride_h negative", v});
  v = good;
  v.stride_b = -good.stride_b;
  r.push_back({"stride_b negative", v});
  return r;
}

// Each bad stride of the view `member` of `base` makes `call` raise an error naming `name`.
template <class Params, class Member, class Call>
void expect_stride_errors(const Params& base, Member member, const char* name, int64_t channels,
                          const Call& call) {
  for (const auto& [why, bad] : bad_strides(base.*member, channels)) {
    SCOPED_TRACE(std::string(name) + ": " + why);
    Params p = base;
    p.*member = bad;
    EXPECT_TRUE(throws_error_naming([&] { call(p); }, {name}));
  }
}

// A view of a params struct, its name and its channel count.
template <class Member>
struct NamedView {
  Member member;
  const char* name;
  int64_t channels;
};

// expect_stride_errors for each of `views`.
template <class Params, class Call, class... Members>
void expect_stride_errors(const Params& base, const Call& call,
                          const NamedView<Members>&... views) {
  (expect_stride_errors(base, views.member, views.name, views.channels, call), ...);
}

// The stride errors of the views every forward and backward takes: the five inputs and out.
template <class P, class Call>
void expect_attention_stride_errors(const P& base, const Dims& d, const Call& call) {
  expect_stride_errors(base, call, NamedView{&P::qp, "qp", d.Dp}, NamedView{&P::kp, "kp", d.Dp},
                       NamedView{&P::q, "q", d.D}, NamedView{&P::k, "k", d.D},
                       NamedView{&P::v, "v", d.D}, NamedView{&P::out, "out", d.D});
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, StridesSelect) {
  const SelectParams base = select_params();
  expect_stride_errors(base, entry::select, NamedView{&SelectParams::qp, "qp", d_.Dp},
                       NamedView{&SelectParams::kp, "kp", d_.Dp});
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, StridesForward) {
  for (bool warmup : {false, true}) {
    SCOPED_TRACE(warmup ? "warmup" : "sparse");
    const ForwardParams base = forward_params(warmup);
    const auto run = [warmup](const ForwardParams& p) { entry::forward(p, warmup); };
    expect_attention_stride_errors(base, d_, run);
  }
}

TEST_F(FLASH_MSA_VALIDATION_SUITE, StridesBackward) {
  using P = BackwardParams;
  for (bool warmup : {false, true}) {
    SCOPED_TRACE(warmup ? "warmup" : "sparse");
    const P base = backward_params(warmup);
    const auto run = [warmup](const P& p) { entry::backward(p, warmup); };
    expect_attention_stride_errors(base, d_, run);
    expect_stride_errors(base, run, NamedView{&P::dout, "dout", d_.D},
                         NamedView{&P::dqp, "dqp", d_.Dp}, NamedView{&P::dkp, "dkp", d_.Dp},
                         NamedView{&P::dq, "dq", d_.D}, NamedView{&P::dk, "dk", d_.D},
                         NamedView{&P::dv, "dv", d_.D});
  }
}

// The public validate() functions reject the same inputs without running anything.
TEST_F(FLASH_MSA_VALIDATION_SUITE, ValidateFunctions) {
  FLASH_MSA_SKIP_UNLESS_RUN_ON_HOST_BUFFERS();
  SelectParams s = select_params();
  EXPECT_MSA_OK(validate(s));
  s.problem.head_dim = 0;
  EXPECT_MSA_ERROR(validate(s), "head_dim");
  ForwardParams f = forward_params(false);
  EXPECT_MSA_OK(validate(f, false));
  f.v.data = nullptr;
  EXPECT_MSA_ERROR(validate(f, false), "v");
  BackwardParams b = backward_params(true);
  EXPECT_MSA_OK(validate(b, true));
  b.dk.stride_s = 3;
  EXPECT_MSA_ERROR(validate(b, true), "dk");
}

}  // namespace
}  // namespace flash_msa::test
