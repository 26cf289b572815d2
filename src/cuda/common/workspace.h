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

}  // namespace flash_msa::cuda
