// The form a row of user-supplied block indices must have (docs/spec.md, section 1: the form
// select writes): valid blocks in [first visible block, own block], strictly ascending, ending
// with the own block, then -1 padding. One rule for every check of indices from outside (the CPU
// backend's, flash_msa.check_indices), host and device code alike, so that a check on the device
// can reject the same rows with the same message.
#pragma once

#include <cstdint>
#include <vector>

#include "flash_msa/msa.h"

#ifdef __CUDACC__
#define FLASH_MSA_HOST_DEVICE __host__ __device__
#else
#define FLASH_MSA_HOST_DEVICE
#endif

namespace flash_msa {

enum class IndexFault : int32_t {
  kNone = 0,
  kOutOfRange,     // below 0 (other than -1 padding) or after the own block
  kOtherDocument,  // before the first block holding a key of the query's document
  kNotAscending,   // not above the slot before it
  kAfterPadding,   // a value other than -1 after the first -1
  kNoOwnBlock,     // the last valid block is not the own block
};

struct IndexCheck {
  IndexFault fault = IndexFault::kNone;
  int64_t slot = -1;  // the slot that breaks the rule (kNoOwnBlock: the number of valid slots)
};

// The first slot of `row` (K entries) that breaks the rule, for a query whose own block is `own`
// and whose document starts in block `first_visible`.
FLASH_MSA_HOST_DEVICE inline IndexCheck check_index_row(const int32_t* row, int64_t K, int64_t own,
                                                        int64_t first_visible) {
  int64_t x = 0;
  for (; x < K && row[x] != -1; ++x) {
    if (row[x] < 0 || row[x] > own) return {IndexFault::kOutOfRange, x};
    if (row[x] < first_visible) return {IndexFault::kOtherDocument, x};
    if (x > 0 && row[x] <= row[x - 1]) return {IndexFault::kNotAscending, x};
  }
  for (int64_t y = x; y < K; ++y)
    if (row[y] != -1) return {IndexFault::kAfterPadding, y};
  if (x == 0 || row[x - 1] != own) return {IndexFault::kNoOwnBlock, x};
  return {};
}

// Throws flash_msa::Error naming the batch, proxy head, query and value where row `row_id`
// (b * Hp * Sq + p * Sq + i) breaks the rule; `starts` from document_starts. Host only.
void validate_index_row(const Problem& problem, const std::vector<int32_t>& starts,
                        int64_t row_id, const int32_t* row);

}  // namespace flash_msa

#undef FLASH_MSA_HOST_DEVICE
