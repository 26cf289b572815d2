// Block indices made outside the library, checked on the device by the CPU backend's rule
// (common/index_rule.h): one thread per (b, p, i) row, the first bad row by atomicMin, then the
// host rebuilds that row's message from a copy of it, so that both backends say the same words.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/check.h"
#include "common/documents.h"
#include "common/index_rule.h"
#include "cuda/common/documents.cuh"
#include "cuda/host/check.h"
#include "flash_msa/cuda.h"

namespace flash_msa::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned long long kNoRow = ~0ull;

__global__ void __launch_bounds__(kThreads)
    first_bad_row_kernel(const CheckIndicesParams p, int64_t queries,
                         unsigned long long* first_bad_row) {
  const Problem& pr = p.problem;
  const int64_t row = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= pr.batch * pr.proxy_heads * queries) return;
  const int b = static_cast<int>(row / queries / pr.proxy_heads);
  const int pos = static_cast<int>(pr.query_offset + row % queries);
  const int first_visible = doc_start_of(pr.cu_seqlens, static_cast<int>(pr.num_docs), b, pos,
                                         static_cast<int>(pr.seqlen)) / kBlockSize;
  const IndexCheck check =
      check_index_row(p.indices + row * pr.top_k, pr.top_k, pos / kBlockSize, first_visible);
  if (check.fault != IndexFault::kNone)
    atomicMin(first_bad_row, static_cast<unsigned long long>(row));
}

}  // namespace

size_t check_indices_workspace_bytes() { return sizeof(unsigned long long); }

void check_indices(const CheckIndicesParams& params, Workspace workspace, cudaStream_t stream) {
  validate(params);
  const Problem& pr = params.problem;
  if (pr.batch * pr.seqlen > INT32_MAX)
    fail("seqlen", "batch * seqlen below 2^31 (int32 token offsets)",
         str(pr.batch) + " * " + str(pr.seqlen));
  if (workspace.bytes < check_indices_workspace_bytes() || workspace.data == nullptr)
    fail("workspace", "check_indices_workspace_bytes() bytes of device memory",
         str(workspace.bytes) + " bytes");
  auto* first_bad_row = static_cast<unsigned long long*>(workspace.data);
  const int64_t rows = pr.batch * pr.proxy_heads * pr.queries();
  FLASH_MSA_CUDA_CHECK(cudaMemsetAsync(first_bad_row, 0xff, sizeof *first_bad_row, stream));
  first_bad_row_kernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0,
                         stream>>>(params, pr.queries(), first_bad_row);
  FLASH_MSA_CHECK_LAUNCH();
  unsigned long long bad = kNoRow;
  std::vector<int32_t> cu(pr.cu_seqlens ? static_cast<size_t>(pr.num_docs + 1) : 0);
  FLASH_MSA_CUDA_CHECK(cudaMemcpyAsync(&bad, first_bad_row, sizeof bad, cudaMemcpyDeviceToHost,
                                       stream));
  if (!cu.empty())
    FLASH_MSA_CUDA_CHECK(cudaMemcpyAsync(cu.data(), pr.cu_seqlens, cu.size() * sizeof(int32_t),
                                         cudaMemcpyDeviceToHost, stream));
  FLASH_MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  // The CPU backend's order: the offsets first (the kernel's document starts assume them valid),
  // then the first bad row.
  const int32_t* host_cu = cu.empty() ? nullptr : cu.data();
  validate_cu_seqlens_values(pr, host_cu);
  if (bad == kNoRow) return;
  std::vector<int32_t> row(static_cast<size_t>(pr.top_k));
  FLASH_MSA_CUDA_CHECK(cudaMemcpy(row.data(), params.indices + bad * pr.top_k,
                                  row.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  validate_index_row(pr, document_starts(pr, host_cu), static_cast<int64_t>(bad), row.data());
}

}  // namespace flash_msa::cuda
