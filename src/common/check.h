// Error reporting shared by every backend: one message format so that callers (and tests) can
// rely on "flash_msa: <argument>: expected <what>, got <what>".
#pragma once

#include <sstream>
#include <string>

#include "flash_msa/msa.h"

namespace flash_msa {

[[noreturn]] inline void fail(const std::string& argument, const std::string& expected,
                              const std::string& got) {
  throw Error("flash_msa: " + argument + ": expected " + expected + ", got " + got);
}

template <class T>
std::string str(const T& value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

}  // namespace flash_msa
