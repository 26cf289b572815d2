// The CPU backend's entry points: a call's checks (the params, then before any tensor is read
// the document offsets in warmup or the index entries, against the documents, in sparse mode),
// then the op in the call's compute type (with_compute_type, tensor.h).
#include <type_traits>

#include "common/documents.h"
#include "cpu/attention.h"
#include "cpu/tensor.h"
#include "flash_msa/cpu.h"

namespace flash_msa::cpu {
namespace {

template <class Params>
void checked_run(const Params& params, bool warmup) {
  validate(params, warmup);
  const Problem& pr = params.problem;
  if (warmup) {
    validate_cu_seqlens_values(pr, pr.cu_seqlens);
  } else {
    validate_indices_values(pr, pr.cu_seqlens, params.indices);
  }
  with_compute_type(pr.dtype, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<Params, ForwardParams>) {
      forward<T>(params, warmup);
    } else {
      backward<T>(params, warmup);
    }
  });
}

}  // namespace

void sparse_forward(const ForwardParams& params) { checked_run(params, false); }
void warmup_forward(const ForwardParams& params) { checked_run(params, true); }
void sparse_backward(const BackwardParams& params) { checked_run(params, false); }
void warmup_backward(const BackwardParams& params) { checked_run(params, true); }

}  // namespace flash_msa::cpu
