// The scheduling stage (reverse index and chunk work items) against a host reference built from
// the same index rows: bucket offsets, the sorted entries of every bucket, and each chunk's
// entry ranges and item counts. The rows mix valid blocks with every kind of entry the kernels
// must skip (negative, past the own block, before the document, duplicates, descending).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "common/problem.h"
#include "cuda/cuda_test_util.h"
#include "cuda/schedule/schedule.h"

namespace flash_msa::test {
namespace {

using CudaSchedule = CudaTest;

template <class T>
std::vector<T> download(const T* device, int64_t count) {
  std::vector<T> host(static_cast<size_t>(count));
  EXPECT_EQ(cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

TEST_F(CudaSchedule, MatchesHostReverseIndex) {
  const Dims d{.B = 2, .S = 1000, .H = 3, .Hk = 3, .Hp = 3, .Hpk = 1, .D = 32, .Dp = 32, .K = 6};
  const std::vector<int32_t> cu = make_cu_seqlens(d, {300, 1500, 1600});
  const cuda::schedule::Shape shape{d.B, d.S, d.Hp, d.K, 0, d.S};
  const int64_t nb = shape.num_blocks();
  std::mt19937 rng(11);
  std::vector<int32_t> indices(static_cast<size_t>(shape.edges()));
  for (int32_t& x : indices) x = static_cast<int32_t>(rng() % (nb + 3)) - 2;  // -2 .. nb
  // Half the rows sorted, as select writes them; the rest stay unsorted.
  for (int64_t r = 0; r < shape.rows(); r += 2)
    std::sort(indices.begin() + r * d.K, indices.begin() + (r + 1) * d.K);

  // Host reference: per bucket (b, p, n) the (token, slot) pairs, token-ascending.
  std::vector<int32_t> doc_start(static_cast<size_t>(d.B * d.S));
  for (size_t x = 0; x + 1 < cu.size(); ++x)
    for (int32_t t = cu[x]; t < cu[x + 1]; ++t)
      doc_start[static_cast<size_t>(t)] =
          cu[x] - (t / static_cast<int32_t>(d.S)) * static_cast<int32_t>(d.S);
  std::vector<std::vector<uint32_t>> buckets(static_cast<size_t>(shape.buckets()));
  for (int64_t row = 0; row < shape.rows(); ++row) {
    const int64_t i = row % d.S, bp = row / d.S, b = bp / d.Hp;
    const int64_t first = doc_start[static_cast<size_t>(b * d.S + i)] / 128, own = i / 128;
    int64_t prev = -1;
    for (int64_t k = 0; k < d.K; ++k) {
      const int64_t n = indices[static_cast<size_t>(row * d.K + k)];
      if (n < first || n > own || n <= prev) continue;
      prev = n;
      buckets[static_cast<size_t>(bp * nb + n)].push_back(static_cast<uint32_t>(i << 6 | k));
    }
  }

  DeviceBuffer g_idx(indices.data(), indices.size() * sizeof(int32_t));
  DeviceBuffer g_cu(cu.data(), cu.size() * sizeof(int32_t));
  DeviceBuffer ws(cuda::schedule::index_workspace_bytes(shape) +
                  cuda::schedule::items_workspace_bytes(shape));
  cudaMemset(ws.get(), 0xff, ws.bytes());
  void* items_ws =
      static_cast<unsigned char*>(ws.get()) + cuda::schedule::index_workspace_bytes(shape);
  const cuda::schedule::Index index = cuda::schedule::build_index(
      shape, static_cast<const int32_t*>(g_idx.get()), static_cast<const int32_t*>(g_cu.get()),
      static_cast<int64_t>(cu.size()) - 1, ws.get(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> begin = download(index.bucket_begin, shape.buckets() + 1);
  const std::vector<uint64_t> entries = download(index.entries, shape.edges());
  EXPECT_EQ(download(index.doc_start, d.B * d.S), doc_start);
  int64_t at = 0;
  for (int64_t u = 0; u < shape.buckets(); ++u) {
    ASSERT_EQ(begin[static_cast<size_t>(u)], at) << "bucket " << u;
    for (uint32_t want : buckets[static_cast<size_t>(u)]) {
      const uint64_t got = entries[static_cast<size_t>(at++)];
      EXPECT_EQ(got >> 32, static_cast<uint64_t>(u));
      EXPECT_EQ(static_cast<uint32_t>(got), want) << "bucket " << u;
    }
  }
  EXPECT_EQ(begin.back(), at);
  for (int64_t x = at; x < shape.edges(); ++x)
    EXPECT_EQ(entries[static_cast<size_t>(x)], ~uint64_t(0));

  for (int64_t chunk : {int64_t(256), d.S}) {
    for (int64_t c0 = 0; c0 < d.S; c0 += chunk) {
      const int64_t c1 = std::min(d.S, c0 + chunk);
      const cuda::schedule::Items items =
          cuda::schedule::build_items(shape, index, c0, c1, items_ws, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<int32_t> item_begin = download(items.item_begin, shape.buckets() + 1);
      const std::vector<int32_t> lo = download(items.range_begin, shape.buckets());
      const std::vector<int32_t> hi = download(items.range_end, shape.buckets());
      int64_t items_so_far = 0;
      for (int64_t u = 0; u < shape.buckets(); ++u) {
        int64_t want_lo = begin[static_cast<size_t>(u)], want_hi = want_lo;
        for (uint32_t e : buckets[static_cast<size_t>(u)]) {
          const int64_t token = e >> 6;
          want_lo += token < c0;
          want_hi += token < c1;
        }
        EXPECT_EQ(lo[static_cast<size_t>(u)], want_lo) << "chunk " << c0 << " bucket " << u;
        EXPECT_EQ(hi[static_cast<size_t>(u)], want_hi) << "chunk " << c0 << " bucket " << u;
        EXPECT_EQ(item_begin[static_cast<size_t>(u)], items_so_far);
        items_so_far +=
            (want_hi - want_lo + cuda::schedule::kItemTokens - 1) / cuda::schedule::kItemTokens;
      }
      EXPECT_EQ(item_begin.back(), items_so_far);
      EXPECT_LE(items_so_far, items.max_items);
    }
  }
}

}  // namespace
}  // namespace flash_msa::test
