// The CUDA backend's entry points for tests/api/validation_test.cc. A call that the public
// validate() (the CPU backend's check) rejects must be rejected by the CUDA entry point with the
// very same message, before it touches the device: it gets no workspace and no stream, and the
// test's buffers are host memory. A call that validate() accepts is not run. A different message,
// or none, throws std::runtime_error naming both, which fails the test. No GPU is needed.
#include <exception>
#include <stdexcept>
#include <string>

#include "common/entry_points.h"
#include "flash_msa/cuda.h"

namespace flash_msa::test::entry {
namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(not a flash_msa::Error) ") + e.what();
  }
  return "(no error)";
}

template <class Check, class Call>
void same_error(Check&& cpu_check, Call&& cuda_call) {
  const std::string want = error_of(cpu_check);
  if (want == "(no error)") return;
  const std::string got = error_of(cuda_call);
  if (got != want)
    throw std::runtime_error("the CUDA backend said \"" + got + "\" where the CPU backend says \"" +
                             want + "\"");
  throw Error(got);
}

}  // namespace

const bool kRunsHostBuffers = false;

void select(const SelectParams& params) {
  same_error([&] { validate(params); }, [&] { cuda::select(params, {}, nullptr); });
}
void forward(const ForwardParams& params, bool warmup) {
  same_error([&] { validate(params, warmup); },
             [&] {
               warmup ? cuda::warmup_forward(params, {}, nullptr)
                      : cuda::sparse_forward(params, {}, nullptr);
             });
}
void backward(const BackwardParams& params, bool warmup) {
  same_error([&] { validate(params, warmup); },
             [&] {
               warmup ? cuda::warmup_backward(params, {}, nullptr)
                      : cuda::sparse_backward(params, {}, nullptr);
             });
}

}  // namespace flash_msa::test::entry
