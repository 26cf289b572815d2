// The C++ API's entry points as tests/api/validation_test.cc calls them. Each test binary defines
// them: flash_msa_cpu_tests the CPU backend's (tests/cpu/entry_points.cc), flash_msa_cuda_tests
// the CUDA backend's checked against the CPU backend's words (tests/cuda/entry_points.cc).
#pragma once

#include <gtest/gtest.h>

#include "flash_msa/msa.h"

// The validation test's suite name in this binary (set by tests/CMakeLists.txt).
#ifndef FLASH_MSA_VALIDATION_SUITE
#error "FLASH_MSA_VALIDATION_SUITE names the validation test's suite"
#endif

namespace flash_msa::test::entry {

// True where the calls run on the buffers the test made in host memory (the CPU backend). Where
// false, a call that validate() accepts is not run, so valid calls, and the checks of values that
// a call makes as it reads them (cu_seqlens, indices), are tested on the CPU backend only.
extern const bool kRunsHostBuffers;

void select(const SelectParams& params);
void forward(const ForwardParams& params, bool warmup);
void backward(const BackwardParams& params, bool warmup);

}  // namespace flash_msa::test::entry

// Skips a test of what only a run on host buffers shows.
#define FLASH_MSA_SKIP_UNLESS_RUN_ON_HOST_BUFFERS()                                      \
  if (!::flash_msa::test::entry::kRunsHostBuffers)                                       \
  GTEST_SKIP() << "a valid call or a check of values: the CPU backend's tests cover it " \
                  "(this binary's entry points take device memory)"
