// Packed documents on the device: the in-row start of a token's document from cu_seqlens.
#pragma once

#include <cstdint>

namespace flash_msa::cuda {

// In-row index of the first token of token s's document (cu_seqlens holds every multiple of S,
// so the document never starts in an earlier batch row); 0 without documents.
__device__ __forceinline__ int doc_start_of(const int32_t* cu, int num_docs, int b, int s,
                                            int seqlen) {
  if (cu == nullptr) return 0;
  const int t = b * seqlen + s;
  int lo = 0, hi = num_docs;  // the last d with cu[d] <= t (skips empty documents)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(cu + mid) <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return max(__ldg(cu + lo) - b * seqlen, 0);
}

}  // namespace flash_msa::cuda
