// The CPU backend's entry points for tests/api/validation_test.cc.
#include "common/entry_points.h"

#include "flash_msa/cpu.h"

namespace flash_msa::test::entry {

const bool kRunsHostBuffers = true;

void select(const SelectParams& params) { cpu::select(params); }
void forward(const ForwardParams& params, bool warmup) {
  warmup ? cpu::warmup_forward(params) : cpu::sparse_forward(params);
}
void backward(const BackwardParams& params, bool warmup) {
  warmup ? cpu::warmup_backward(params) : cpu::sparse_backward(params);
}

}  // namespace flash_msa::test::entry
