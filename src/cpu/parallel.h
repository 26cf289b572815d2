// Threads of the CPU backend: plain std::thread workers, no OpenMP runtime. The library is
// loaded into processes that bring their own OpenMP (PyTorch ships one); std::thread keeps a
// second runtime, and its thread pool, out of them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "flash_msa/cpu.h"

namespace flash_msa::cpu {

// Calls worker(t) for t = 0 .. threads - 1, each on its own thread (t = 0 on the caller's), and
// returns when all are done. The first exception a worker throws is rethrown here.
template <class Worker>
void run_workers(int threads, const Worker& worker) {
  std::exception_ptr error;
  std::mutex error_mutex;
  auto guarded = [&](int t) {
    try {
      worker(t);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(std::max(threads - 1, 0)));
  for (int t = 1; t < threads; ++t) pool.emplace_back(guarded, t);
  guarded(0);
  for (std::thread& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// Rows [0, n) in chunks of `chunk` consecutive rows. Static: chunk c always goes to thread
// c % threads, so per-thread partial sums depend on the thread count only. Dynamic: chunks go in
// order to whichever thread is free, for rows of uneven cost whose results do not depend on it.
// Each worker(t, rows) loop runs `for (int64_t r; rows.next(r);)`.
class StaticRows {
 public:
  StaticRows(int64_t n, int64_t chunk, int threads, int t)
      : n_(n), chunk_(chunk), stride_(chunk * threads), begin_(chunk * t) {}
  bool next(int64_t& r) {
    if (at_ == end_) {
      if (begin_ >= n_) return false;
      at_ = begin_;
      end_ = std::min(begin_ + chunk_, n_);
      begin_ += stride_;
    }
    r = at_++;
    return true;
  }

 private:
  int64_t n_, chunk_, stride_, begin_, at_ = 0, end_ = 0;
};

class DynamicRows {
 public:
  DynamicRows(int64_t n, int64_t chunk, std::atomic<int64_t>& counter)
      : n_(n), chunk_(chunk), counter_(counter) {}
  bool next(int64_t& r) {
    if (at_ == end_) {
      const int64_t begin = counter_.fetch_add(chunk_);
      if (begin >= n_) return false;
      at_ = begin;
      end_ = std::min(begin + chunk_, n_);
    }
    r = at_++;
    return true;
  }

 private:
  int64_t n_, chunk_;
  std::atomic<int64_t>& counter_;
  int64_t at_ = 0, end_ = 0;
};

template <class Worker>
void parallel_static(int64_t n, int64_t chunk, const Worker& worker) {
  const int threads = num_threads();
  run_workers(threads, [&](int t) {
    StaticRows rows(n, chunk, threads, t);
    worker(t, rows);
  });
}

template <class Worker>
void parallel_dynamic(int64_t n, int64_t chunk, const Worker& worker) {
  std::atomic<int64_t> counter{0};
  run_workers(num_threads(), [&](int t) {
    DynamicRows rows(n, chunk, counter);
    worker(t, rows);
  });
}

}  // namespace flash_msa::cpu
