// The scheduling stage: document starts, edges, a radix sort by (bucket, token), bucket offsets
// (an integer count and a scan, so they are the same every run), and per chunk the work items.
// Everything is enqueued on the caller's stream; no value comes back to the host.
#include <algorithm>
#include <bit>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "cuda/host/check.h"
#include "cuda/host/plan.h"
#include "cuda/schedule/edges.cuh"
#include "cuda/schedule/schedule.h"

namespace flash_msa::cuda::schedule {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kInvalidEntry = ~uint64_t(0);

int sort_end_bit(const Shape& shape) {
  return 32 + std::bit_width(static_cast<uint64_t>(shape.buckets()));
}

size_t sort_temp_bytes(const Shape& shape) {
  size_t sort = 0, scan = 0;
  FLASH_MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(
      nullptr, sort, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      shape.edges(), 0, sort_end_bit(shape)));
  FLASH_MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr),
                                                     shape.buckets() + 1));
  return std::max(sort, scan);
}

size_t scan_temp_bytes(const Shape& shape) {
  size_t scan = 0;
  FLASH_MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr),
                                                     shape.buckets() + 1));
  return scan;
}

struct IndexArrays {
  int32_t* doc_start;
  uint64_t* keys_in;
  uint64_t* keys_out;
  int32_t* bucket_count;
  int32_t* bucket_begin;
  void* temp;
  size_t temp_bytes;
  size_t total;
};

IndexArrays index_arrays(const Shape& shape, void* workspace) {
  Carver c(workspace);
  IndexArrays a{};
  a.doc_start = c.take<int32_t>(shape.batch * shape.seqlen);
  a.keys_in = c.take<uint64_t>(shape.edges());
  a.keys_out = c.take<uint64_t>(shape.edges());
  a.bucket_count = c.take<int32_t>(shape.buckets() + 1);
  a.bucket_begin = c.take<int32_t>(shape.buckets() + 1);
  a.temp_bytes = sort_temp_bytes(shape);
  a.temp = c.take<unsigned char>(static_cast<int64_t>(a.temp_bytes));
  a.total = c.used();
  return a;
}

struct TileArrays {
  int32_t* blocks;
  int32_t* count;
  int32_t* listed;
  int32_t* listed_count;
  size_t total;
};

TileArrays tile_arrays(const Shape& shape, void* workspace) {
  Carver c(workspace);
  TileArrays a{};
  a.blocks = c.take<int32_t>(shape.buckets() * shape.top_k);
  a.count = c.take<int32_t>(shape.buckets());
  a.listed = c.take<int32_t>(shape.buckets());
  a.listed_count = c.take<int32_t>(1);
  a.total = c.used();
  return a;
}

struct ItemArrays {
  int32_t* item_count;
  int32_t* item_begin;
  int32_t* range_begin;
  int32_t* range_end;
  void* temp;
  size_t temp_bytes;
  size_t total;
};

ItemArrays item_arrays(const Shape& shape, void* workspace) {
  Carver c(workspace);
  ItemArrays a{};
  a.item_count = c.take<int32_t>(shape.buckets() + 1);
  a.item_begin = c.take<int32_t>(shape.buckets() + 1);
  a.range_begin = c.take<int32_t>(shape.buckets());
  a.range_end = c.take<int32_t>(shape.buckets());
  a.temp_bytes = scan_temp_bytes(shape);
  a.temp = c.take<unsigned char>(static_cast<int64_t>(a.temp_bytes));
  a.total = c.used();
  return a;
}

// doc_start[t] for the flattened token t = b * S + s: the in-row index of its document start.
__global__ void doc_start_kernel(const int32_t* __restrict__ cu_seqlens, int num_docs,
                                 int64_t tokens, int seqlen, int32_t* __restrict__ doc_start) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  int start = 0;
  if (cu_seqlens) {
    int lo = 0, hi = num_docs;  // largest d with cu_seqlens[d] <= t
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (__ldg(cu_seqlens + mid) <= t)
        lo = mid;
      else
        hi = mid;
    }
    start = max(0, static_cast<int>(__ldg(cu_seqlens + lo) - (t / seqlen) * seqlen));
  }
  doc_start[t] = start;
}

// One CTA of 128 threads per tile bp * NB + n that holds queries of the call (Tiles): thread r
// compares the valid blocks of the query at position 128 n + r with those of the tile's first
// query; when all agree, thread 0 lists the tile.
__global__ void __launch_bounds__(128)
    tiles_kernel(const int32_t* __restrict__ indices, const int32_t* __restrict__ doc_start,
                 int seqlen, int query_offset, int queries, int proxy_heads, int top_k,
                 int num_blocks, int first_tile, int tiles, int32_t* __restrict__ blocks,
                 int32_t* __restrict__ count, int32_t* __restrict__ listed,
                 int32_t* __restrict__ listed_count) {
  const int bp = static_cast<int>(blockIdx.x / unsigned(tiles));
  const int n = first_tile + static_cast<int>(blockIdx.x % unsigned(tiles));
  const int b = bp / proxy_heads;
  // The positions of the tile's queries: [lo, hi), never empty.
  const int lo = max(n * 128, query_offset);
  const int hi = min(min(n * 128 + 128, seqlen), query_offset + queries);
  auto row_of = [&](int position) {
    return indices + (int64_t(bp) * queries + position - query_offset) * top_k;
  };
  auto slots_of = [&](int position) {
    return valid_slots(row_of(position), top_k, n,
                       __ldg(doc_start + int64_t(b) * seqlen + position) / 128);
  };
  const int position = n * 128 + static_cast<int>(threadIdx.x);
  const uint64_t first = slots_of(lo);
  bool same = true;
  if (position > lo && position < hi) {
    uint64_t mine = slots_of(position), theirs = first;
    const int32_t *a = row_of(position), *f = row_of(lo);
    same = __popcll(mine) == __popcll(theirs);
    while (same && mine != 0) {
      same = __ldg(a + __ffsll(mine) - 1) == __ldg(f + __ffsll(theirs) - 1);
      mine &= mine - 1;
      theirs &= theirs - 1;
    }
  }
  same = __syncthreads_and(same);
  if (threadIdx.x != 0) return;
  const int tile = bp * num_blocks + n;
  const uint64_t slots = same ? first : 0;
  count[tile] = __popcll(slots);
  if (slots == 0) return;
  const int32_t* f = row_of(lo);
  int x = 0;
  for (uint64_t rest = slots; rest != 0; rest &= rest - 1)
    blocks[int64_t(tile) * top_k + x++] = __ldg(f + __ffsll(rest) - 1);
  listed[atomicAdd(listed_count, 1)] = tile;
}

// One thread per index row (b, p, query): its K sort keys and the bucket counts. Entries hold
// the query's position `token` (query_offset + its index). tile_count (Tiles::count, or null):
// the queries of listed tiles get no edges.
__global__ void edges_kernel(const int32_t* __restrict__ indices,
                             const int32_t* __restrict__ doc_start,
                             const int32_t* __restrict__ tile_count, int64_t rows, int seqlen,
                             int query_offset, int queries, int proxy_heads, int top_k,
                             int num_blocks, uint64_t* __restrict__ keys,
                             int32_t* __restrict__ bucket_count) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const int token = query_offset + static_cast<int>(row % queries);
  const int64_t bp = row / queries;
  const int b = static_cast<int>(bp / proxy_heads);
  const int32_t* idx = indices + row * top_k;
  const bool listed = tile_count && __ldg(tile_count + bp * num_blocks + token / 128) > 0;
  const uint64_t mask = listed ? 0
                               : valid_slots(idx, top_k, token / 128,
                                             __ldg(doc_start + int64_t(b) * seqlen + token) / 128);
  for (int k = 0; k < top_k; ++k) {
    uint64_t key = kInvalidEntry;
    if ((mask >> k) & 1) {
      const int64_t bucket = bp * num_blocks + __ldg(idx + k);
      key = (static_cast<uint64_t>(bucket) << 32) | (static_cast<uint64_t>(token) << kSlotBits) |
            static_cast<uint64_t>(k);
      // Neighbouring tokens share blocks (all of a block's tokens its own): one atomic per
      // bucket and warp.
      const unsigned peers = __match_any_sync(__activemask(), bucket);
      if (threadIdx.x % 32 == __ffs(peers) - 1) atomicAdd(bucket_count + bucket, __popc(peers));
    }
    keys[row * top_k + k] = key;
  }
}

// One thread per bucket: its entries inside [chunk_begin, chunk_end) and their item count.
__global__ void items_kernel(const uint64_t* __restrict__ entries,
                             const int32_t* __restrict__ bucket_begin, int64_t buckets,
                             int chunk_begin, int chunk_end, int32_t* __restrict__ range_begin,
                             int32_t* __restrict__ range_end, int32_t* __restrict__ item_count) {
  const int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u > buckets) return;
  if (u == buckets) {  // the scan's total slot
    item_count[u] = 0;
    return;
  }
  auto first_at_least = [&](int token) {  // first entry of the bucket with token >= `token`
    int lo = __ldg(bucket_begin + u), hi = __ldg(bucket_begin + u + 1);
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (entry_token(entries[mid]) < token)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo;
  };
  const int lo = first_at_least(chunk_begin), hi = first_at_least(chunk_end);
  range_begin[u] = lo;
  range_end[u] = hi;
  item_count[u] = (hi - lo + kItemTokens - 1) / kItemTokens;
}

unsigned grid_of(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

size_t index_workspace_bytes(const Shape& shape) { return index_arrays(shape, nullptr).total; }
size_t items_workspace_bytes(const Shape& shape) { return item_arrays(shape, nullptr).total; }
size_t tiles_workspace_bytes(const Shape& shape) { return tile_arrays(shape, nullptr).total; }

int64_t max_items(const Shape& shape, int64_t chunk_tokens) {
  // Each bucket adds at most one partial item.
  return shape.batch * shape.proxy_heads * chunk_tokens * shape.top_k / kItemTokens +
         shape.buckets();
}

void launch_doc_start(const int32_t* cu_seqlens, int64_t num_docs, int64_t batch, int64_t seqlen,
                      int32_t* doc_start, cudaStream_t stream) {
  const int64_t tokens = batch * seqlen;
  doc_start_kernel<<<grid_of(tokens), kThreads, 0, stream>>>(
      cu_seqlens, static_cast<int>(num_docs), tokens, static_cast<int>(seqlen), doc_start);
  FLASH_MSA_CHECK_LAUNCH();
}

Index build_index(const Shape& shape, const int32_t* indices, const int32_t* cu_seqlens,
                  int64_t num_docs, void* workspace, cudaStream_t stream, void* tiles_workspace,
                  Tiles* tiles) {
  const IndexArrays a = index_arrays(shape, workspace);
  launch_doc_start(cu_seqlens, num_docs, shape.batch, shape.seqlen, a.doc_start, stream);
  const int32_t* tile_count = nullptr;
  if (tiles_workspace) {
    const TileArrays t = tile_arrays(shape, tiles_workspace);
    FLASH_MSA_CUDA_CHECK(cudaMemsetAsync(t.listed_count, 0, sizeof(int32_t), stream));
    const int64_t first_tile = shape.query_offset / 128;
    const int64_t query_tiles = (shape.query_offset + shape.queries - 1) / 128 - first_tile + 1;
    tiles_kernel<<<static_cast<unsigned>(shape.batch * shape.proxy_heads * query_tiles), 128, 0,
                   stream>>>(indices, a.doc_start, static_cast<int>(shape.seqlen),
                             static_cast<int>(shape.query_offset), static_cast<int>(shape.queries),
                             static_cast<int>(shape.proxy_heads), static_cast<int>(shape.top_k),
                             static_cast<int>(shape.num_blocks()), static_cast<int>(first_tile),
                             static_cast<int>(query_tiles), t.blocks, t.count, t.listed,
                             t.listed_count);
    FLASH_MSA_CHECK_LAUNCH();
    tile_count = t.count;
    *tiles = {t.blocks, t.count, t.listed, t.listed_count};
  }
  FLASH_MSA_CUDA_CHECK(cudaMemsetAsync(
      a.bucket_count, 0, static_cast<size_t>(shape.buckets() + 1) * sizeof(int32_t), stream));
  edges_kernel<<<grid_of(shape.rows()), kThreads, 0, stream>>>(
      indices, a.doc_start, tile_count, shape.rows(), static_cast<int>(shape.seqlen),
      static_cast<int>(shape.query_offset), static_cast<int>(shape.queries),
      static_cast<int>(shape.proxy_heads), static_cast<int>(shape.top_k),
      static_cast<int>(shape.num_blocks()), a.keys_in, a.bucket_count);
  FLASH_MSA_CHECK_LAUNCH();
  size_t temp = a.temp_bytes;
  FLASH_MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(
      a.temp, temp, a.keys_in, a.keys_out, shape.edges(), 0, sort_end_bit(shape), stream));
  temp = a.temp_bytes;
  FLASH_MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(a.temp, temp, a.bucket_count, a.bucket_begin,
                                                     shape.buckets() + 1, stream));
  return {a.doc_start, a.keys_out, a.bucket_begin};
}

Items build_items(const Shape& shape, const Index& index, int64_t chunk_begin, int64_t chunk_end,
                  void* workspace, cudaStream_t stream) {
  const ItemArrays a = item_arrays(shape, workspace);
  items_kernel<<<grid_of(shape.buckets() + 1), kThreads, 0, stream>>>(
      index.entries, index.bucket_begin, shape.buckets(), static_cast<int>(chunk_begin),
      static_cast<int>(chunk_end), a.range_begin, a.range_end, a.item_count);
  FLASH_MSA_CHECK_LAUNCH();
  size_t temp = a.temp_bytes;
  FLASH_MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(a.temp, temp, a.item_count, a.item_begin,
                                                     shape.buckets() + 1, stream));
  return {a.item_begin, a.range_begin, a.range_end, max_items(shape, chunk_end - chunk_begin)};
}

}  // namespace flash_msa::cuda::schedule
