// Hopper (wgmma) dense forward of warmup mode (SPEC sections 2, 3 and 5 with T(p, i) = every
// visible key): out and lse of each main head, and lse_p of each proxy head, query-outer.
//
// One CTA takes 128 queries of one head (blockIdx.y < H: main head; >= H: proxy head, which
// only needs its log-sum-exp) and walks the key blocks of 128 from the block of its first
// query's document start to its last query's block. K (and V) stream through a ring of three
// shared buffers, each filled by the bulk tensor copy engine (tma_sm90.cuh) and completing on
// its mbarrier; the warpgroup that releases a buffer last refills it with the block three
// ahead. Each of the two warpgroups owns 64 query rows: S = Q K^T (eight m64n128k16 wgmma from
// shared memory, fp32), masked to the visible keys [doc start, query] only in the blocks that
// need it, an online softmax in log2 units (row maxima over the lane quad, row sums per thread
// until the end), O rescaled, and O += P V with P rounded to the dtype in registers (m64n64k16
// per 64-column panel of V, read MN-major). A warpgroup issues S of the next block together
// with P V of this one and runs the next block's softmax while they are on the tensor cores;
// the two warpgroups take turns to issue (named barriers kTurnBarrier + wg), so that one's
// softmax runs under the other's products. The query tiles go out longest first (the last
// queries see the most keys), so the short ones fill the tail.
//
// The same kernel is the sparse forward's tile path (forward/forward.cu): given the listed tiles
// of schedule::Tiles (128 query positions of key block n whose queries all selected the same
// blocks), CTA i (G + 1) + s takes listed tile i for main head p G + s (s < G) or proxy head p
// (s = G) and walks the tile's blocks instead of every visible one; the mask is the same.
//
// The forward's KL value is not computed here: the backward's pass has the teacher at hand and
// gives it (warmup/warmup.cu runs the portable forward when a caller asks for it in the forward).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/tile_sm80.cuh"
#include "cuda/common/tma_sm90.cuh"
#include "cuda/common/warp_reduce.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/forward/sm90/dense_sm90.h"

namespace flash_msa::cuda::sm90::dense_forward {

inline constexpr int kWarpgroups = 2;
inline constexpr int kThreads = 128 * kWarpgroups;
inline constexpr int kRows = 64;                       // query rows of a warpgroup
inline constexpr int kTileRows = kRows * kWarpgroups;  // query rows of a CTA
inline constexpr int kKeys = 128;                      // keys of a block
inline constexpr int kD = 128;                         // D = Dp (two 64-column panels)
inline constexpr int kStages = 3;                      // key-block buffers
inline constexpr float kLn2 = 0.6931471805599453f;

// SW128-panel tiles (wgmma_sm90.cuh): each warpgroup's Q rows, and kStages buffers of K and V;
// plus slack to align the start to 1024 bytes.
struct SharedMemory {
  static constexpr int kQTile = kRows * kD * 2;
  static constexpr int kKvTile = kKeys * kD * 2;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kWarpgroups * kQTile;
  static constexpr int kV = kK + kStages * kKvTile;
  static constexpr int kBytes = kV + kStages * kKvTile + 1024;
};

// The kernel's parameters and the tensor maps of the key-side views (panel_map: 64 columns by
// 128 keys a box).
struct ForwardParams {
  DenseForwardParams p;
  CUtensorMap k, v, kp;
};

template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    forward_kernel(const __grid_constant__ ForwardParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const DenseForwardParams& p = params.p;
  using Smem = SharedMemory;
  extern __shared__ unsigned char smem_raw[];
  __shared__ BufferRing<kStages, kWarpgroups> ring;  // the key blocks
  unsigned char* smem = align_1024(smem_raw);
  const KernelShape& sh = p.shape;
  // The CTA's query tile (query index q_begin: rows q_begin .. q_begin + 127, those of the call
  // valid), its head (>= H: proxy head head - H) and batch row; its key blocks, first_block + j
  // or list[j] for j < blocks.
  int q_begin, b, head, first_block = 0, blocks;
  const int32_t* list = nullptr;
  if (p.tiles.blocks) {
    const int slots = sh.group + 1;
    const int i = static_cast<int>(blockIdx.x) / slots, slot = static_cast<int>(blockIdx.x) % slots;
    if (i >= __ldg(p.tiles.listed_count)) return;
    const int tile = __ldg(p.tiles.listed + i);
    const int bp = tile / sh.num_blocks, n = tile % sh.num_blocks, ph = bp % sh.proxy_heads;
    q_begin = n * kKeys - sh.query_offset;
    b = bp / sh.proxy_heads;
    head = slot < sh.group ? ph * sh.group + slot : sh.heads + ph;
    list = p.tiles.blocks + int64_t(tile) * sh.top_k;
    blocks = __ldg(p.tiles.count + tile);
  } else {
    const int tiles = (sh.queries + kTileRows - 1) / kTileRows;
    q_begin = (tiles - 1 - static_cast<int>(blockIdx.x)) * kTileRows;
    b = blockIdx.z;
    head = blockIdx.y;
  }
  const bool proxy = head >= sh.heads;  // CTA-uniform
  const int wg = warpgroup_index(), wt = threadIdx.x % 128;
  const int warp = wt / 32, lane = threadIdx.x % 32;

  const ConstView qv = proxy ? p.qp : p.q;
  const int q_head = proxy ? head - sh.heads : head;
  const int k_head = proxy ? q_head / sh.proxy_group : head / sh.kv_group;
  const T* q = static_cast<const T*>(qv.data) + b * qv.stride_b + q_head * qv.stride_h;
  const float scale_log2 = proxy ? sh.proxy_scale_log2 : sh.scale_log2;
  const int32_t* doc_start = p.doc_start ? p.doc_start + int64_t(b) * sh.seqlen : nullptr;
  auto doc_of = [&](int position) { return doc_start ? __ldg(doc_start + position) : 0; };

  if (!list) {
    const int q_last = min(q_begin + kTileRows, sh.queries) - 1;
    first_block = doc_of(sh.query_offset + q_begin) / kKeys;
    blocks = (sh.query_offset + q_last) / kKeys - first_block + 1;
  }
  auto block_of = [&](int j) { return list ? __ldg(list + j) : first_block + j; };

  // Block j into buffer j % kStages (one thread): K (Kp) and, for a main head, V; keys past the
  // sequence zero-filled.
  const CUtensorMap& k_map = proxy ? params.kp : params.k;
  auto load_block = [&](int j) {
    const int st = j % kStages, key0 = block_of(j) * kKeys;
    mbarrier_arrive_expect_tx(ring.bar(j), (proxy ? 1 : 2) * Smem::kKvTile);
#pragma unroll
    for (int panel = 0; panel < kD / 64; ++panel) {
      const int offset = st * Smem::kKvTile + panel * kKeys * 128;
      tma_load_panel(smem + Smem::kK + offset, k_map, 64 * panel, key0, k_head, b, ring.bar(j));
      if (!proxy)
        tma_load_panel(smem + Smem::kV + offset, params.v, 64 * panel, key0, k_head, b,
                       ring.bar(j));
    }
  };
  if (threadIdx.x == 0) {
    ring.init();
    for (int j = 0; j < kStages && j < blocks; ++j) load_block(j);
  }
  // This warpgroup is done with block j's buffer (thread 0 of the warpgroup, after the
  // warpgroup's products that read it are complete); the last of the two refills it with block
  // j + kStages.
  auto release = [&](int j) {
    if (wt == 0 && ring.release(j) && j + kStages < blocks) load_block(j + kStages);
  };

  unsigned char* s_q = smem + Smem::kQ + wg * Smem::kQTile;
  copy_rows_sw128<kRows, kD, 128>(
      s_q,
      [&](int r, bool& valid) {
        const int qi = q_begin + kRows * wg + r;
        valid = qi >= 0 && qi < sh.queries;
        return q + min(max(qi, 0), sh.queries - 1) * qv.stride_s;
      },
      wt);
  cp_async_commit();

  // This lane's rows 16 warp + 8 h + lane / 4 of the warpgroup's tile: query index, whether
  // the call has it, position and document start (rows that are no query see nothing).
  int qi[2], position[2], first[2];
  bool row_in[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    qi[h] = q_begin + kRows * wg + 16 * warp + 8 * h + lane / 4;
    row_in[h] = qi[h] >= 0 && qi[h] < sh.queries;
    position[h] = sh.query_offset + min(max(qi[h], 0), sh.queries - 1);
    first[h] = row_in[h] ? doc_of(position[h]) : INT_MAX;
    if (!row_in[h]) position[h] = INT_MIN;
  }

  const uint64_t q_desc = sw128_desc(smem_addr(s_q), 16, 1024);
  // S = Q K^T of block j (its buffer), one commit group.
  auto issue_scores = [&](float(&s)[64], int j) {
    const uint64_t k_desc =
        sw128_desc(smem_addr(smem + Smem::kK + (j % kStages) * Smem::kKvTile), 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t offset = (kk % 4) * 32;  // bytes into the panel's 128-byte rows
      wgmma_m64n128k16_ss<T, 0, 0>(s, desc_add(q_desc, (kk / 4) * kRows * 128 + offset),
                                   desc_add(k_desc, (kk / 4) * kKeys * 128 + offset), kk > 0);
    }
    wgmma_commit();
  };
  // O += P V of block j (P in a), one commit group.
  auto issue_values = [&](float(&o)[2][32], const uint32_t(&a)[kKeys / 16][4], int j) {
    const uint64_t v_desc =
        sw128_desc(smem_addr(smem + Smem::kV + (j % kStages) * Smem::kKvTile), kKeys * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int panel = 0; panel < 2; ++panel)
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma_m64n64k16_rs_mn<T>(o[panel], a[kk],
                                 desc_add(v_desc, panel * kKeys * 128 + kk * 16 * 128), true);
    wgmma_commit();
  };
  float m[2] = {-INFINITY, -INFINITY};  // row maxima of scale * log2(e) * S so far
  float l[2] = {0.f, 0.f};              // this thread's part of the row sums
  // Block j's scores in s masked to the visible keys, then the online softmax: new row maxima
  // (four independent chains per row), the rescale factor alpha of what came before, and
  // P = exp2(S scale log2e - m) in place.
  auto softmax = [&](float(&s)[64], int j, float(&alpha)[2]) {
    int lo[2], hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col0 = block_of(j) * kKeys + 2 * (lane % 4);
      lo[h] = first[h] == INT_MAX ? INT_MAX : first[h] - col0;
      hi[h] = position[h] == INT_MIN ? INT_MIN : position[h] - col0;
    }
    mask_columns(s, lo, hi);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mc[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int c = 0; c < 16; ++c)
        mc[c % 4] = fmaxf(mc[c % 4], fmaxf(s[4 * c + 2 * h], s[4 * c + 2 * h + 1]));
      const float mx = quad_max(fmaxf(fmaxf(mc[0], mc[1]), fmaxf(mc[2], mc[3])));
      const float m_new = fmaxf(m[h], mx * scale_log2);
      // A row with no visible key so far keeps m = -inf: subtract 0 then, not -inf.
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = fast_exp2(m[h] - base);
      m[h] = m_new;
      float lc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        s[4 * c + 2 * h] = fast_exp2(fmaf(s[4 * c + 2 * h], scale_log2, -base));
        s[4 * c + 2 * h + 1] = fast_exp2(fmaf(s[4 * c + 2 * h + 1], scale_log2, -base));
        lc[c % 4] += s[4 * c + 2 * h] + s[4 * c + 2 * h + 1];
      }
      l[h] = fmaf(l[h], alpha[h], (lc[0] + lc[1]) + (lc[2] + lc[3]));
    }
  };
  // P (keys 16 kk ..) rounded to the input dtype as the A registers of O += P V.
  auto to_a = [](const float(&s)[64], uint32_t(&a)[kKeys / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const float(&lo4)[4] = *reinterpret_cast<const float(*)[4]>(s + 8 * kk);
      const float(&hi4)[4] = *reinterpret_cast<const float(*)[4]>(s + 8 * kk + 4);
      portable::acc_to_a<T>(a[kk], lo4, hi4);
    }
  };
  // The two warpgroups take turns to issue their products, warpgroup 0 first: bar.sync by the
  // warpgroup whose turn it is, bar.arrive by the other. Both walk the same blocks, so both
  // have as many turns, and warpgroup 1 arrives for no turn after warpgroup 0's last: no
  // arrival is left over.
  auto wait_turn = [&] { named_barrier_sync(kTurnBarrier + wg, 2 * 128); };
  auto pass_turn = [&] { named_barrier_arrive(kTurnBarrier + (1 - wg), 2 * 128); };

  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();  // each warpgroup's Q rows are in place; the barriers are set up

  float o[2][32];
#pragma unroll
  for (int j = 0; j < 32; ++j) o[0][j] = o[1][j] = 0.f;
  float s[64], alpha[2];
  uint32_t a[kKeys / 16][4];
  // Block 0's S and softmax.
  ring.wait(0);
  issue_scores(s, 0);
  wgmma_wait<0>();
  fence_operands(s);
  softmax(s, 0, alpha);
  if (!proxy) {  // CTA-uniform; each branch keeps its products and waits in straight lines
    to_a(s, a);
    if (wg == 1) pass_turn();  // warpgroup 0 takes the first turn
    // Per block j: the products (S of block j + 1 into s, O += P V of block j from a), the
    // softmax of block j + 1 while P V runs, then O rescaled for block j + 1.
    for (int j = 0; j < blocks; ++j) {
      const bool next = j + 1 < blocks;
      if (next) ring.wait(j + 1);
      wait_turn();
      // After the last block this recomputes the current S, unused: an unconditional issue
      // keeps branches away from the products in flight (the compiler would wait first).
      issue_scores(s, next ? j + 1 : j);
      issue_values(o, a, j);
      if (wg == 0 || next) pass_turn();
      wgmma_wait<1>();  // S of block j + 1
      fence_operands(s);
      alpha[0] = alpha[1] = 1.f;
      if (next) softmax(s, j + 1, alpha);
      fence_operands(s);
      wgmma_wait<0>();  // P V of block j
      fence_operands(o[0]);
      fence_operands(o[1]);
      fence_operands(a);
      release(j);
#pragma unroll
      for (int panel = 0; panel < 2; ++panel)
#pragma unroll
        for (int x = 0; x < 32; ++x) o[panel][x] *= alpha[(x % 4) / 2];
      to_a(s, a);
    }
  } else {
    // The proxy head needs only the log-sum-exp: S and the softmax per block, a turn for each
    // block after the first.
    release(0);
    if (wg == 1 && blocks > 1) pass_turn();
    for (int j = 1; j < blocks; ++j) {
      ring.wait(j);
      wait_turn();
      issue_scores(s, j);
      if (wg == 0 || j + 1 < blocks) pass_turn();
      wgmma_wait<0>();
      fence_operands(s);
      softmax(s, j, alpha);
      release(j);
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(l[h]);
    if (!row_in[h]) continue;
    const int bh = b * (proxy ? sh.proxy_heads : sh.heads) + q_head;
    const float lse = sum > 0.f ? (m[h] + fast_log2(sum)) * kLn2 : -INFINITY;
    if (lane % 4 == 0) (proxy ? p.lse_proxy : p.lse)[sh.query_row(bh, position[h])] = lse;
    if (proxy) continue;
    const float inv = sum > 0.f ? fast_rcp(sum) : 0.f;
    T* row = static_cast<T*>(p.out.data) + b * p.out.stride_b + head * p.out.stride_h +
             int64_t(qi[h]) * p.out.stride_s;
#pragma unroll
    for (int panel = 0; panel < 2; ++panel)
#pragma unroll
      for (int t = 0; t < 8; ++t)
        *reinterpret_cast<uint32_t*>(row + 64 * panel + 8 * t + 2 * (lane % 4)) =
            Elem<T>::pack(o[panel][4 * t + 2 * h] * inv, o[panel][4 * t + 2 * h + 1] * inv);
  }
#else
  __trap();  // built without sm_90a code: warmup_kernels() never picks it then
#endif
}

}  // namespace flash_msa::cuda::sm90::dense_forward

namespace flash_msa::cuda::sm90 {

template <class T>
void launch_dense_forward(const DenseForwardParams& params, cudaStream_t stream) {
  using namespace dense_forward;
  const auto& sh = params.shape;
  const int hk = sh.heads / sh.kv_group, hpk = sh.proxy_heads / sh.proxy_group;
  const ForwardParams launch{.p = params,
                             .k = panel_map("k", params.k, 2, sh.batch, hk, sh.seqlen, kD),
                             .v = panel_map("v", params.v, 2, sh.batch, hk, sh.seqlen, kD),
                             .kp = panel_map("kp", params.kp, 2, sh.batch, hpk, sh.seqlen, kD)};
  // The tile path: every tile of the queries might be listed, each for G + 1 heads.
  const int query_tiles = (sh.query_offset + sh.queries - 1) / kKeys - sh.query_offset / kKeys + 1;
  const dim3 grid =
      params.tiles.blocks
          ? dim3(static_cast<unsigned>(int64_t(sh.batch) * sh.proxy_heads * query_tiles *
                                       (sh.group + 1)))
          : dim3((sh.queries + kTileRows - 1) / kTileRows, sh.heads + sh.proxy_heads, sh.batch);
  FLASH_MSA_CUDA_CHECK(cudaFuncSetAttribute(
      forward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, SharedMemory::kBytes));
  forward_kernel<T><<<grid, kThreads, SharedMemory::kBytes, stream>>>(launch);
  FLASH_MSA_CHECK_LAUNCH();
}

}  // namespace flash_msa::cuda::sm90
