#include "common/check.h"
#include "flash_msa/msa.h"

namespace flash_msa {

namespace {

// By the enums' values: DType's names and element sizes, SelectPrecision's names.
struct DTypeInfo {
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {{"float32", 4}, {"float16", 2}, {"bfloat16", 2}, {"float64", 8}};
constexpr const char* kSelectPrecisions[] = {"exact", "float8_e4m3"};

// The entry of `table` at an enum's value, null where the value lies outside it.
template <class Entry, size_t N, class Enum>
const Entry* entry(const Entry (&table)[N], Enum value) {
  const auto at = static_cast<int64_t>(value);
  return at >= 0 && at < static_cast<int64_t>(N) ? &table[at] : nullptr;
}

}  // namespace

const char* dtype_name(DType dtype) {
  const DTypeInfo* e = entry(kDTypes, dtype);
  return e ? e->name : "unknown";
}

size_t dtype_size(DType dtype) {
  const DTypeInfo* e = entry(kDTypes, dtype);
  if (!e) fail("dtype", "float32, float64, float16 or bfloat16", str(static_cast<int32_t>(dtype)));
  return e->size;
}

const char* select_precision_name(SelectPrecision precision) {
  const char* const* e = entry(kSelectPrecisions, precision);
  return e ? *e : "unknown";
}

}  // namespace flash_msa
