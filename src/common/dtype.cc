#include "common/check.h"
#include "flash_msa/msa.h"

namespace flash_msa {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return 8;
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  fail("dtype", "float32, float64, float16 or bfloat16", str(static_cast<int32_t>(dtype)));
}

const char* select_precision_name(SelectPrecision precision) {
  switch (precision) {
    case SelectPrecision::kExact:
      return "exact";
    case SelectPrecision::kFloat8E4M3:
      return "float8_e4m3";
  }
  return "unknown";
}

}  // namespace flash_msa
