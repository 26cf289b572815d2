// Hopper (sm_90) tensor copies: mbarriers, the bulk tensor copy engine (TMA) loading SW128-panel
// tiles (wgmma_sm90.cuh) from a strided [B, H, rows, C] view of 16-bit elements, and the host
// side that encodes the view's tensor map (PTX ISA, "Tensor copy" and "mbarrier"; CUDA driver
// API, cuTensorMapEncodeTiled).
//
// A copy completes on an mbarrier of the CTA: one thread announces the bytes it expects
// (arrive_expect_tx) and issues the copies, whose bytes count the transaction down; waiters
// spin on the barrier's phase parity, which flips each time a phase completes.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/host/check.h"
#include "flash_msa/msa.h"

namespace flash_msa::cuda::sm90 {

// An mbarrier of `count` arrivals, made visible to the copy engine (one thread).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival on `bar`, which then also waits for `bytes` of copies to land.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` of `bar` has completed (acquire: what the copies
// wrote is visible after it).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
}

// The box at element coordinates (c, row, h, b) of the view of `map` (64 16-bit columns, 128
// rows: one SW128 panel of 128 rows, rows past the view zero-filled) into `dst` (1024-byte
// aligned), completing on `bar`.
__device__ __forceinline__ void tma_load_panel(void* dst, const CUtensorMap& map, int c, int row,
                                               int h, int b, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c), "r"(row), "r"(h), "r"(b),
      "r"(smem_addr(bar))
      : "memory");
}
// `bytes` (a multiple of 16) of contiguous global memory at src (16-byte aligned) into dst,
// completing on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// atomicAdd on shared memory with acquire-release order (the CTA): what the adders did before
// their adds happens before what the one that reads the last count does after it.
__device__ __forceinline__ uint32_t shared_add_acq_rel(uint32_t* at, uint32_t value) {
  uint32_t old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;\n"
               : "=r"(old)
               : "r"(smem_addr(at)), "r"(value)
               : "memory");
  return old;
}

// A ring of kStages shared buffers that the copy engine fills and kConsumers warpgroups read, in
// shared memory: block j of a walk goes to buffer j % kStages. One thread init()s it and issues
// block j's copies on bar(j); each warpgroup wait(j)s for the block and, once done with it
// (thread 0 of the warpgroup, after the products that read it are complete), release(j)s it;
// the release that returns true is the last, and its thread refills the buffer with block
// j + kStages.
template <int kStages, int kConsumers>
struct BufferRing {
  uint64_t full[kStages];      // buffer s holds its block (the copy engine's bytes)
  uint32_t released[kStages];  // releases of the buffer's blocks, in total

  __device__ __forceinline__ void init() {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      released[s] = 0;
    }
  }
  __device__ __forceinline__ uint64_t* bar(int j) { return &full[j % kStages]; }
  __device__ __forceinline__ void wait(int j) { mbarrier_wait(bar(j), (j / kStages) % 2); }
  __device__ __forceinline__ bool release(int j) {
    fence_async_shared();  // this warpgroup's reads come before the copy engine's writes
    return (shared_add_acq_rel(&released[j % kStages], 1) + 1) % kConsumers == 0;
  }
};

// Rows per box of a panel map: one SW128 panel of 128 rows.
inline constexpr int kPanelRows = 128;

// The tensor map of a [batch, heads, rows, cols] view of 16-bit elements (`element_bytes` per
// element of the view's own type: 2, or 1 for FP8 rows moved as 16-bit pairs; cols = the row's
// 16-bit columns, a multiple of 64), in boxes of one SW128 panel (64 columns, 128 rows), rows
// past `rows` read as zero. The view's strides are 16-byte multiples (check_vector_view); an
// error names the argument `name`.
inline CUtensorMap panel_map(const char* name, const ConstView& view, int element_bytes,
                             int batch, int heads, int rows, int cols) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FLASH_MSA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                          cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      throw std::runtime_error("flash_msa: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  // A dimension of one element takes any stride: give it the next-inner extent, a valid one.
  const cuuint64_t row_bytes = cuuint64_t(view.stride_s) * element_bytes;
  const cuuint64_t head_bytes =
      heads > 1 ? cuuint64_t(view.stride_h) * element_bytes : row_bytes * rows;
  const cuuint64_t batch_bytes =
      batch > 1 ? cuuint64_t(view.stride_b) * element_bytes : head_bytes * heads;
  const cuuint64_t dims[4] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(heads),
                              cuuint64_t(batch)};
  const cuuint64_t strides[3] = {row_bytes, head_bytes, batch_bytes};
  const cuuint32_t box[4] = {64, kPanelRows, 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(view.data),
                            dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(std::string("flash_msa: ") + name + ": the view (strides " +
                std::to_string(view.stride_b) + ", " + std::to_string(view.stride_h) + ", " +
                std::to_string(view.stride_s) + ") has no tensor map for the Hopper kernels " +
                "(CUresult " + std::to_string(r) + ")");
  return map;
}

}  // namespace flash_msa::cuda::sm90
