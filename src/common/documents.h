// Packed documents as per-token start offsets: key j is visible to query i iff
// start(i) <= j <= i, because documents are contiguous token ranges inside a batch row.
#pragma once

#include <cstdint>
#include <vector>

#include "flash_msa/msa.h"

namespace flash_msa {

// For every flattened token b * S + s, the in-row index of the first token of its document.
// `host_cu_seqlens` must already be valid (validate_cu_seqlens_values); null: one document per row.
inline std::vector<int32_t> document_starts(const Problem& problem,
                                            const int32_t* host_cu_seqlens) {
  const int64_t seqlen = problem.seqlen;
  std::vector<int32_t> starts(static_cast<size_t>(problem.batch * seqlen), 0);
  if (host_cu_seqlens == nullptr) return starts;
  for (int64_t d = 0; d < problem.num_docs; ++d) {
    const int64_t begin = host_cu_seqlens[d], end = host_cu_seqlens[d + 1];
    for (int64_t t = begin; t < end; ++t)
      starts[static_cast<size_t>(t)] = static_cast<int32_t>(begin - (t / seqlen) * seqlen);
  }
  return starts;
}

}  // namespace flash_msa
