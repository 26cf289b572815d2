// msa_step: one MSA training step on random inputs, the project's main job.
//
// Sparse mode: select -> sparse forward -> sparse backward over the cached selection, which also
// gives the KL value (from the teacher it recomputes, as MSAAttention does by default).
// --warmup: dense warmup forward -> warmup backward. Runs on the GPU when built with
// CUDA and a device is present (or --device cuda), else on the CPU reference. Prints the time of
// each stage, the KL value, selection statistics, and per tensor an L2 norm and a bitwise digest
// (FNV-1a 64 of its raw bytes) so that two builds or devices can be compared bit for bit.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "common/host_data.h"  // dtype conversions and random values, shared with the tests
#include "cpu/parallel.h"
#include "flash_msa/cpu.h"
#include "flash_msa/msa.h"

#ifdef FLASH_MSA_WITH_CUDA
#include <cuda_runtime.h>

#include "flash_msa/cuda.h"
#endif

namespace {

using flash_msa::DType;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct HelpRequested {};

constexpr const char* kUsage =
    "usage: msa_step [options]   (--name value or --name=value)\n"
    "  --device cpu|cuda      backend (default: cuda when built with CUDA and a GPU is present)\n"
    "  --batch N              batch rows B (default 1)\n"
    "  --seqlen N             tokens per row S (default 32768 on cuda, 8192 on cpu)\n"
    "  --heads N              main query heads H (default 64)\n"
    "  --kv-heads N           main key/value heads Hk (default 4)\n"
    "  --proxy-heads N        proxy query heads Hp (default 4)\n"
    "  --proxy-kv-heads N     proxy key heads Hpk (default 1)\n"
    "  --head-dim N           D (default 128)\n"
    "  --proxy-head-dim N     Dp (default 128)\n"
    "  --top-k N              selected TOKENS per query and proxy head, a multiple of 128, as\n"
    "                         Python's top_k (default 2048)\n"
    "  --top-k-blocks N       the same in blocks of 128 tokens, K (default 16)\n"
    "  --docs N               N equal packed documents per batch row (default 1: no packing)\n"
    "  --dtype bf16|fp16|fp32 input dtype (fp32: cpu only; default bf16)\n"
    "  --warmup               dense warmup step instead of select + sparse\n"
    "  --seed N               random seed of the inputs (default 0)\n"
    "  --iters N              timed iterations per stage on cuda (default 10)\n"
    "  --help                 this text\n"
    "output: on cuda the kernels each part of the step runs and why (\"kernels:\" lines), the\n"
    "time of each stage, the KL value, selection statistics (sparse), then a checksum line per\n"
    "tensor (indices, out, dqp, dkp, dq, dk, dv): its L2 norm (in double,\n"
    "to compare values) and fnv1a64, the 64-bit FNV-1a digest of its raw bytes in the step's\n"
    "dtype. The inputs depend only on the options and --seed, so equal digests from two builds\n"
    "or devices mean bitwise-equal results.\n";

struct Options {
  std::string device;  // empty: automatic
  int64_t batch = 1, seqlen = 0, heads = 64, kv_heads = 4, proxy_heads = 4, proxy_kv_heads = 1;
  int64_t head_dim = 128, proxy_head_dim = 128, top_k_blocks = 16, docs = 1, iters = 10;
  uint64_t seed = 0;
  DType dtype = DType::kBFloat16;
  bool warmup = false;
};

int64_t parse_int(const std::string& flag, const std::string& value, int64_t min) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || v < min)
    throw UsageError(flag + ": expected an integer >= " + std::to_string(min) + ", got '" + value +
                     "'");
  return v;
}

// The options that take a value.
constexpr const char* kValueFlags[] = {
    "--device",   "--dtype",        "--batch",          "--seqlen",   "--heads",
    "--kv-heads", "--proxy-heads",  "--proxy-kv-heads", "--head-dim", "--proxy-head-dim",
    "--top-k",    "--top-k-blocks", "--docs",           "--seed",     "--iters"};

Options parse(int argc, char** argv) {
  Options o;
  std::string top_k_flag;  // the --top-k* option given, if any
  for (int a = 1; a < argc; ++a) {
    std::string flag = argv[a], value;
    if (flag.rfind("--", 0) != 0 && flag != "-h")
      throw UsageError("unexpected argument '" + flag + "' (options start with --)");
    const size_t eq = flag.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    if (flag == "--help" || flag == "-h") throw HelpRequested{};
    if (flag == "--warmup") {
      if (inline_value) throw UsageError("--warmup takes no value");
      o.warmup = true;
      continue;
    }
    if (std::find(std::begin(kValueFlags), std::end(kValueFlags), flag) == std::end(kValueFlags))
      throw UsageError("unknown option " + flag);
    if (!inline_value) {
      if (a + 1 >= argc) throw UsageError(flag + ": missing value");
      value = argv[++a];
    }
    if (flag == "--device") {
      if (value != "cpu" && value != "cuda")
        throw UsageError("--device: expected cpu or cuda, got '" + value + "'");
      o.device = value;
    } else if (flag == "--dtype") {
      if (value == "bf16")
        o.dtype = DType::kBFloat16;
      else if (value == "fp16")
        o.dtype = DType::kFloat16;
      else if (value == "fp32")
        o.dtype = DType::kFloat32;
      else
        throw UsageError("--dtype: expected bf16, fp16 or fp32, got '" + value + "'");
    } else if (flag == "--top-k" || flag == "--top-k-blocks") {
      if (!top_k_flag.empty() && top_k_flag != flag)
        throw UsageError(flag + ": give --top-k (tokens) or --top-k-blocks, not both");
      top_k_flag = flag;
      if (flag == "--top-k-blocks") {
        o.top_k_blocks = parse_int(flag, value, 1);
      } else {
        const int64_t tokens = parse_int(flag, value, 1);
        if (tokens % flash_msa::kBlockSize != 0)
          throw UsageError("--top-k: counts tokens and expects a multiple of the block size " +
                           std::to_string(flash_msa::kBlockSize) + ", got " + value +
                           " (--top-k-blocks counts blocks)");
        o.top_k_blocks = tokens / flash_msa::kBlockSize;
      }
    } else if (flag == "--batch")
      o.batch = parse_int(flag, value, 1);
    else if (flag == "--seqlen")
      o.seqlen = parse_int(flag, value, 1);
    else if (flag == "--heads")
      o.heads = parse_int(flag, value, 1);
    else if (flag == "--kv-heads")
      o.kv_heads = parse_int(flag, value, 1);
    else if (flag == "--proxy-heads")
      o.proxy_heads = parse_int(flag, value, 1);
    else if (flag == "--proxy-kv-heads")
      o.proxy_kv_heads = parse_int(flag, value, 1);
    else if (flag == "--head-dim")
      o.head_dim = parse_int(flag, value, 1);
    else if (flag == "--proxy-head-dim")
      o.proxy_head_dim = parse_int(flag, value, 1);
    else if (flag == "--docs")
      o.docs = parse_int(flag, value, 1);
    else if (flag == "--seed")
      o.seed = static_cast<uint64_t>(parse_int(flag, value, 0));
    else if (flag == "--iters")
      o.iters = parse_int(flag, value, 1);
  }
  return o;
}

// A contiguous [n0, n1, n2, n3] host tensor stored in the step's dtype.
struct HostTensor {
  DType dtype;
  int64_t n0, n1, n2, n3;
  std::vector<unsigned char> bytes;

  HostTensor(DType t, int64_t a, int64_t b, int64_t c, int64_t d)
      : dtype(t),
        n0(a),
        n1(b),
        n2(c),
        n3(d),
        bytes(static_cast<size_t>(a * b * c * d) * flash_msa::dtype_size(t)) {}
  int64_t count() const { return n0 * n1 * n2 * n3; }
  float get(int64_t i) const { return flash_msa::host::load_element(dtype, bytes.data(), i); }
  void set(int64_t i, float f) { flash_msa::host::store_element(dtype, bytes.data(), i, f); }
  // sqrt(sum x^2) in double; per-thread partial sums added in thread order.
  double l2_norm() const {
    std::vector<double> partial(static_cast<size_t>(flash_msa::cpu::num_threads()), 0.0);
    flash_msa::cpu::parallel_static(count(), kChunk, [&](int t, flash_msa::cpu::StaticRows& it) {
      for (int64_t i; it.next(i);) {
        const double x = get(i);
        partial[static_cast<size_t>(t)] += x * x;
      }
    });
    double s = 0;
    for (double x : partial) s += x;
    return std::sqrt(s);
  }
  uint64_t digest() const { return flash_msa::host::fnv1a64(bytes.data(), bytes.size()); }
  static constexpr int64_t kChunk = 1 << 16;  // elements per thread chunk
};

// Unit-variance values from a counter hash (host_data.h), filled in parallel, reproducibly.
void fill_random(HostTensor& t, uint64_t seed, uint64_t stream) {
  flash_msa::cpu::parallel_static(
      t.count(), HostTensor::kChunk, [&](int, flash_msa::cpu::StaticRows& it) {
        for (int64_t i; it.next(i);)
          t.set(i, flash_msa::host::counter_uniform(seed, stream, static_cast<uint64_t>(i)));
      });
}

flash_msa::ConstView cview(const HostTensor& t, const void* data) {
  return flash_msa::contiguous_view<const void>(data, t.n1, t.n2, t.n3);
}
flash_msa::MutView mview(const HostTensor& t, void* data) {
  return flash_msa::contiguous_view<void>(data, t.n1, t.n2, t.n3);
}

// Bytes of the step's host buffers (Step below): the 12 tensors, the indices and the statistics.
double step_host_bytes(const Options& o, int64_t S) {
  const double t = static_cast<double>(flash_msa::dtype_size(o.dtype)), rows = double(o.batch) * S;
  const double main = rows * o.heads * o.head_dim, kv = rows * o.kv_heads * o.head_dim;
  const double proxy = rows * (o.proxy_heads + o.proxy_kv_heads) * o.proxy_head_dim;
  return t * (4 * main + 4 * kv + 2 * proxy) +
         4.0 * rows * (o.proxy_heads * o.top_k_blocks + o.heads + o.proxy_heads);
}

std::string gib(double bytes) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3g GiB", bytes / double(1ull << 30));
  return buf;
}

// A problem too large for this machine is an error naming its size, before any allocation.
void check_fits_host(const Options& o, int64_t S) {
  const double need = step_host_bytes(o, S);
  const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  if (need > have)
    throw flash_msa::Error("flash_msa: seqlen: expected a problem whose host buffers fit the " +
                           gib(have) + " of host memory, got " + std::to_string(S) +
                           " tokens needing " + gib(need));
}

struct Step {
  flash_msa::Problem problem;
  std::vector<int32_t> cu_seqlens;  // host copy; empty without packing
  HostTensor qp, kp, q, k, v, dout, out, dqp, dkp, dq, dk, dv;
  std::vector<int32_t> indices;
  std::vector<float> lse, lse_proxy;
  float kl = NAN;
  double ms_select = 0, ms_forward = 0, ms_backward = 0;

  Step(const Options& o, int64_t S)
      : qp(o.dtype, o.batch, o.proxy_heads, S, o.proxy_head_dim),
        kp(o.dtype, o.batch, o.proxy_kv_heads, S, o.proxy_head_dim),
        q(o.dtype, o.batch, o.heads, S, o.head_dim),
        k(o.dtype, o.batch, o.kv_heads, S, o.head_dim),
        v(o.dtype, o.batch, o.kv_heads, S, o.head_dim),
        dout(o.dtype, o.batch, o.heads, S, o.head_dim),
        out(o.dtype, o.batch, o.heads, S, o.head_dim),
        dqp(o.dtype, o.batch, o.proxy_heads, S, o.proxy_head_dim),
        dkp(o.dtype, o.batch, o.proxy_kv_heads, S, o.proxy_head_dim),
        dq(o.dtype, o.batch, o.heads, S, o.head_dim),
        dk(o.dtype, o.batch, o.kv_heads, S, o.head_dim),
        dv(o.dtype, o.batch, o.kv_heads, S, o.head_dim) {
    flash_msa::Problem& p = problem;
    p.batch = o.batch;
    p.seqlen = S;
    p.heads = o.heads;
    p.kv_heads = o.kv_heads;
    p.proxy_heads = o.proxy_heads;
    p.proxy_kv_heads = o.proxy_kv_heads;
    p.head_dim = o.head_dim;
    p.proxy_head_dim = o.proxy_head_dim;
    p.top_k = o.top_k_blocks;
    p.scale = 1.f / std::sqrt(static_cast<float>(o.head_dim));
    p.proxy_scale = 1.f / std::sqrt(static_cast<float>(o.proxy_head_dim));
    p.dtype = o.dtype;
    if (o.docs > 1) {
      for (int64_t b = 0; b < o.batch; ++b)
        for (int64_t d = 0; d < o.docs; ++d)
          cu_seqlens.push_back(static_cast<int32_t>(b * S + d * S / o.docs));
      cu_seqlens.push_back(static_cast<int32_t>(o.batch * S));
      cu_seqlens.erase(std::unique(cu_seqlens.begin(), cu_seqlens.end()), cu_seqlens.end());
      p.num_docs = static_cast<int64_t>(cu_seqlens.size()) - 1;
    }
    uint64_t stream = 0;
    for (HostTensor* t : {&qp, &kp, &q, &k, &v, &dout}) fill_random(*t, o.seed, ++stream);
    indices.assign(static_cast<size_t>(o.batch * o.proxy_heads * S * o.top_k_blocks), -1);
    lse.assign(static_cast<size_t>(o.batch * o.heads * S), NAN);
    lse_proxy.assign(static_cast<size_t>(o.batch * o.proxy_heads * S), NAN);
  }
};

// ---- CPU backend: one timed run per stage ----

double time_ms(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void run_cpu(Step& s, bool warmup) {
  flash_msa::Problem pr = s.problem;
  if (!s.cu_seqlens.empty()) pr.cu_seqlens = s.cu_seqlens.data();
  const float kl_grad = 1.f;
  if (!warmup) {
    const flash_msa::SelectParams sp{pr, cview(s.qp, s.qp.bytes.data()),
                                     cview(s.kp, s.kp.bytes.data()), s.indices.data()};
    s.ms_select = time_ms([&] { flash_msa::cpu::select(sp); });
  }
  flash_msa::ForwardParams fp;
  fp.problem = pr;
  fp.indices = warmup ? nullptr : s.indices.data();
  fp.qp = cview(s.qp, s.qp.bytes.data());
  fp.kp = cview(s.kp, s.kp.bytes.data());
  fp.q = cview(s.q, s.q.bytes.data());
  fp.k = cview(s.k, s.k.bytes.data());
  fp.v = cview(s.v, s.v.bytes.data());
  fp.out = mview(s.out, s.out.bytes.data());
  fp.lse = s.lse.data();
  fp.lse_proxy = s.lse_proxy.data();
  s.ms_forward = time_ms([&] {
    if (warmup)
      flash_msa::cpu::warmup_forward(fp);
    else
      flash_msa::cpu::sparse_forward(fp);
  });
  flash_msa::BackwardParams bp;
  bp.problem = pr;
  bp.indices = fp.indices;
  bp.qp = fp.qp;
  bp.kp = fp.kp;
  bp.q = fp.q;
  bp.k = fp.k;
  bp.v = fp.v;
  bp.out = cview(s.out, s.out.bytes.data());
  bp.dout = cview(s.dout, s.dout.bytes.data());
  bp.lse = s.lse.data();
  bp.lse_proxy = s.lse_proxy.data();
  bp.kl_grad = &kl_grad;
  bp.kl = &s.kl;
  bp.dqp = mview(s.dqp, s.dqp.bytes.data());
  bp.dkp = mview(s.dkp, s.dkp.bytes.data());
  bp.dq = mview(s.dq, s.dq.bytes.data());
  bp.dk = mview(s.dk, s.dk.bytes.data());
  bp.dv = mview(s.dv, s.dv.bytes.data());
  s.ms_backward = time_ms([&] {
    if (warmup)
      flash_msa::cpu::warmup_backward(bp);
    else
      flash_msa::cpu::sparse_backward(bp);
  });
}

// ---- CUDA backend: median of --iters cudaEvent-timed runs after one warm-up run ----

#ifdef FLASH_MSA_WITH_CUDA

#define MSA_STEP_CUDA(expr)                                                           \
  do {                                                                                \
    const cudaError_t err_ = (expr);                                                  \
    if (err_ != cudaSuccess)                                                          \
      throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(err_)); \
  } while (0)

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (bytes == 0) return;
    if (cudaMalloc(&ptr_, bytes) == cudaSuccess) return;
    cudaGetLastError();  // clear the allocation error
    size_t free = 0, total = 0;
    cudaMemGetInfo(&free, &total);
    throw std::runtime_error("device memory: expected " + gib(double(bytes)) +
                             " more to fit the device, got " + gib(double(free)) + " free of " +
                             gib(double(total)));
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_) { other.ptr_ = nullptr; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr_); }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

DeviceBuffer upload(const void* host, size_t bytes) {
  DeviceBuffer d(bytes);
  if (bytes > 0) MSA_STEP_CUDA(cudaMemcpy(d.get(), host, bytes, cudaMemcpyHostToDevice));
  return d;
}

void download(void* host, const DeviceBuffer& d, size_t bytes) {
  if (bytes > 0) MSA_STEP_CUDA(cudaMemcpy(host, d.get(), bytes, cudaMemcpyDeviceToHost));
}

double time_cuda_ms(int64_t iters, cudaStream_t stream, const std::function<void()>& f) {
  f();
  cudaEvent_t start, stop;
  MSA_STEP_CUDA(cudaEventCreate(&start));
  MSA_STEP_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int64_t it = 0; it < iters; ++it) {
    MSA_STEP_CUDA(cudaEventRecord(start, stream));
    f();
    MSA_STEP_CUDA(cudaEventRecord(stop, stream));
    MSA_STEP_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    MSA_STEP_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void run_cuda(Step& s, bool warmup, int64_t iters) {
  namespace cu = flash_msa::cuda;
  cudaStream_t stream;
  MSA_STEP_CUDA(cudaStreamCreate(&stream));
  auto up = [](const HostTensor& t) { return upload(t.bytes.data(), t.bytes.size()); };
  const DeviceBuffer qp = up(s.qp), kp = up(s.kp), q = up(s.q), k = up(s.k), v = up(s.v),
                     dout = up(s.dout);
  DeviceBuffer out(s.out.bytes.size()), dqp(s.dqp.bytes.size()), dkp(s.dkp.bytes.size()),
      dq(s.dq.bytes.size()), dk(s.dk.bytes.size()), dv(s.dv.bytes.size());
  DeviceBuffer indices(s.indices.size() * sizeof(int32_t));
  DeviceBuffer lse(s.lse.size() * sizeof(float)), lse_proxy(s.lse_proxy.size() * sizeof(float));
  DeviceBuffer kl(sizeof(float));
  const float one = 1.f;
  const DeviceBuffer kl_grad = upload(&one, sizeof one);
  const DeviceBuffer cu_seqlens = upload(s.cu_seqlens.data(), s.cu_seqlens.size() * 4);
  flash_msa::Problem pr = s.problem;
  if (!s.cu_seqlens.empty()) pr.cu_seqlens = static_cast<const int32_t*>(cu_seqlens.get());
  int32_t* idx = warmup ? nullptr : static_cast<int32_t*>(indices.get());

  if (!warmup) {
    const flash_msa::SelectParams sp{pr, cview(s.qp, qp.get()), cview(s.kp, kp.get()), idx};
    const size_t bytes = cu::select_workspace_bytes(sp);
    DeviceBuffer ws(bytes);
    s.ms_select = time_cuda_ms(iters, stream, [&] { cu::select(sp, {ws.get(), bytes}, stream); });
  }
  flash_msa::ForwardParams fp;
  fp.problem = pr;
  fp.indices = idx;
  fp.qp = cview(s.qp, qp.get());
  fp.kp = cview(s.kp, kp.get());
  fp.q = cview(s.q, q.get());
  fp.k = cview(s.k, k.get());
  fp.v = cview(s.v, v.get());
  fp.out = mview(s.out, out.get());
  fp.lse = static_cast<float*>(lse.get());
  fp.lse_proxy = static_cast<float*>(lse_proxy.get());
  {
    const size_t bytes = cu::forward_workspace_bytes(fp, warmup);
    DeviceBuffer ws(bytes);
    s.ms_forward = time_cuda_ms(iters, stream, [&] {
      if (warmup)
        cu::warmup_forward(fp, {ws.get(), bytes}, stream);
      else
        cu::sparse_forward(fp, {ws.get(), bytes}, stream);
    });
  }
  flash_msa::BackwardParams bp;
  bp.problem = pr;
  bp.indices = idx;
  bp.qp = fp.qp;
  bp.kp = fp.kp;
  bp.q = fp.q;
  bp.k = fp.k;
  bp.v = fp.v;
  bp.out = cview(s.out, out.get());
  bp.dout = cview(s.dout, dout.get());
  bp.lse = fp.lse;
  bp.lse_proxy = fp.lse_proxy;
  bp.kl_grad = static_cast<const float*>(kl_grad.get());
  bp.kl = kl.get();
  bp.dqp = mview(s.dqp, dqp.get());
  bp.dkp = mview(s.dkp, dkp.get());
  bp.dq = mview(s.dq, dq.get());
  bp.dk = mview(s.dk, dk.get());
  bp.dv = mview(s.dv, dv.get());
  {
    const size_t bytes = cu::backward_workspace_bytes(bp, warmup);
    DeviceBuffer ws(bytes);
    s.ms_backward = time_cuda_ms(iters, stream, [&] {
      if (warmup)
        cu::warmup_backward(bp, {ws.get(), bytes}, stream);
      else
        cu::sparse_backward(bp, {ws.get(), bytes}, stream);
    });
  }
  MSA_STEP_CUDA(cudaStreamSynchronize(stream));
  if (!warmup) download(s.indices.data(), indices, s.indices.size() * sizeof(int32_t));
  download(&s.kl, kl, sizeof(float));
  download(s.out.bytes.data(), out, s.out.bytes.size());
  download(s.dqp.bytes.data(), dqp, s.dqp.bytes.size());
  download(s.dkp.bytes.data(), dkp, s.dkp.bytes.size());
  download(s.dq.bytes.data(), dq, s.dq.bytes.size());
  download(s.dk.bytes.data(), dk, s.dk.bytes.size());
  download(s.dv.bytes.data(), dv, s.dv.bytes.size());
  MSA_STEP_CUDA(cudaStreamDestroy(stream));
}

bool cuda_available() { return flash_msa::cuda::device_available(); }

#else

bool cuda_available() { return false; }

#endif

void print_selection_stats(const Step& s) {
  const flash_msa::Problem& p = s.problem;
  const int64_t rows = p.batch * p.proxy_heads * p.seqlen;
  // Selections are summarised serially: integer counts and a distance sum in row order.
  int64_t valid = 0, own_only = 0;
  double distance = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t own = (r % p.seqlen) / flash_msa::kBlockSize;
    int64_t n_valid = 0;
    for (int64_t x = 0; x < p.top_k; ++x) {
      const int32_t e = s.indices[static_cast<size_t>(r * p.top_k + x)];
      if (e < 0) continue;
      ++n_valid;
      distance += static_cast<double>(own - e);
    }
    valid += n_valid;
    own_only += n_valid == 1;
  }
  std::printf(
      "selection: %.3f valid blocks per row, %.4f of rows own block only, "
      "mean distance from the own block %.2f blocks\n",
      static_cast<double>(valid) / rows, static_cast<double>(own_only) / rows,
      valid ? distance / valid : 0.0);
}

// Per tensor: the L2 norm, to compare values, and the FNV-1a 64 digest of the raw bytes, to
// compare bits (two builds or devices on the same options and --seed).
void print_checksums(const Step& s, bool warmup) {
  const std::pair<const char*, const HostTensor*> tensors[] = {{"out", &s.out}, {"dqp", &s.dqp},
                                                               {"dkp", &s.dkp}, {"dq", &s.dq},
                                                               {"dk", &s.dk},   {"dv", &s.dv}};
  constexpr int kTensors = static_cast<int>(std::size(tensors));
  uint64_t digest[kTensors];  // one thread per tensor: FNV-1a is serial within a buffer
  flash_msa::cpu::run_workers(kTensors, [&](int t) { digest[t] = tensors[t].second->digest(); });
  std::printf(
      "checksums: l2 = L2 norm; fnv1a64 = FNV-1a 64 of the raw bytes (%s; indices int32), "
      "equal digests = bitwise-equal tensors\n",
      flash_msa::dtype_name(s.problem.dtype));
  if (!warmup)
    std::printf("checksum indices %18s  fnv1a64 %016llx\n", "",
                static_cast<unsigned long long>(flash_msa::host::fnv1a64(
                    s.indices.data(), s.indices.size() * sizeof(int32_t))));
  for (int t = 0; t < kTensors; ++t)
    std::printf("checksum %-7s l2 %.9e  fnv1a64 %016llx\n", tensors[t].first,
                tensors[t].second->l2_norm(), static_cast<unsigned long long>(digest[t]));
}

int run(const Options& o) {
  const bool gpu = o.device == "cuda" || (o.device.empty() && cuda_available());
  if (gpu && !cuda_available())
    throw UsageError("--device cuda: no CUDA device (or built without CUDA)");
  if (gpu && o.dtype == DType::kFloat32) throw UsageError("--dtype fp32: cpu only");
  const int64_t S = o.seqlen > 0 ? o.seqlen : (gpu ? 32768 : 8192);
  if (o.docs > S) throw UsageError("--docs: expected at most seqlen documents");
  check_fits_host(o, S);
  Step s(o, S);
  // The CPU backward's sums over rows depend on the thread count (not on the run): its digests
  // compare between runs with the same FLASH_MSA_NUM_THREADS.
  const std::string device =
      gpu ? "cuda" : "cpu (" + std::to_string(flash_msa::cpu::num_threads()) + " threads)";
  std::printf(
      "msa_step: %s %s, %s, B=%lld S=%lld H=%lld Hk=%lld Hp=%lld Hpk=%lld D=%lld "
      "Dp=%lld top_k=%lld tokens (%lld blocks) docs=%lld seed=%llu\n",
      device.c_str(), flash_msa::dtype_name(o.dtype), o.warmup ? "warmup" : "sparse",
      static_cast<long long>(o.batch), static_cast<long long>(S), static_cast<long long>(o.heads),
      static_cast<long long>(o.kv_heads), static_cast<long long>(o.proxy_heads),
      static_cast<long long>(o.proxy_kv_heads), static_cast<long long>(o.head_dim),
      static_cast<long long>(o.proxy_head_dim),
      static_cast<long long>(o.top_k_blocks * flash_msa::kBlockSize),
      static_cast<long long>(o.top_k_blocks), static_cast<long long>(o.docs),
      static_cast<unsigned long long>(o.seed));
#ifdef FLASH_MSA_WITH_CUDA
  if (gpu) {
    // The kernels of each part of the step, as the entry points choose them (cuda::explain).
    for (const flash_msa::cuda::StageChoice& c :
         flash_msa::cuda::explain(s.problem, {.warmup = o.warmup}))
      std::printf("kernels: %-18s %-24s (%s)\n", c.stage.c_str(), c.variant.c_str(),
                  c.reason.c_str());
    run_cuda(s, o.warmup, o.iters);
  } else {
    run_cpu(s, o.warmup);
  }
#else
  run_cpu(s, o.warmup);
#endif
  const char* timing = gpu ? "median of cudaEvent runs" : "one run";
  if (!o.warmup) std::printf("select:   %10.3f ms (%s)\n", s.ms_select, timing);
  std::printf("forward:  %10.3f ms\n", s.ms_forward);
  std::printf("backward: %10.3f ms\n", s.ms_backward);
  std::printf("kl: %.9g (from the backward)\n", static_cast<double>(s.kl));
  if (!o.warmup) print_selection_stats(s);
  print_checksums(s, o.warmup);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const HelpRequested&) {
    std::fputs(kUsage, stdout);
    return 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "msa_step: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const flash_msa::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "msa_step: host memory: an allocation failed (the step's host buffers "
                         "fit the machine's memory, but not what is free now)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "msa_step: %s\n", e.what());
    return 1;
  }
}
