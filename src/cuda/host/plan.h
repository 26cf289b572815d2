// Host-side carving of a caller's workspace into 256-byte aligned arrays. The same code sizes
// the workspace (from a null base: only counts) and lays it out for a launch, so the two
// cannot disagree.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flash_msa::cuda {

class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<unsigned char*>(base)) {}
  template <class T>
  T* take(int64_t count) {
    T* at = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  void* take_bytes(size_t bytes) { return take<unsigned char>(static_cast<int64_t>(bytes)); }
  size_t used() const { return used_; }

 private:
  unsigned char* base_;
  size_t used_ = 0;
};

// The token chunk of the sparse passes: as few chunks as chunks of at most `max_chunk` tokens
// (a multiple of 128) allow, all of one size (a multiple of 128), so that no chunk is a short
// tail, which would run every kernel of its pass at a fraction of the GPU. Chunks that fit in
// one (or no) chunk are returned as they are.
inline int64_t even_chunk(int64_t seqlen, int64_t max_chunk) {
  if (max_chunk <= 0 || max_chunk >= seqlen) return max_chunk;
  const int64_t chunks = (seqlen + max_chunk - 1) / max_chunk;
  return ((seqlen + chunks - 1) / chunks + 127) / 128 * 128;
}

}  // namespace flash_msa::cuda
