// Error reporting shared by every backend: one message format so that callers (and tests) can
// rely on "flash_msa: <argument>: expected <what>, got <what>".
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

#include "flash_msa/msa.h"

namespace flash_msa {

[[noreturn]] inline void fail(const std::string& argument, const std::string& expected,
                              const std::string& got) {
  throw Error("flash_msa: " + argument + ": expected " + expected + ", got " + got);
}

// Numbers in messages. No iostreams: their locale facets are process-wide state that an
// extension module must not instantiate on its own (a copy of a facet id in the module picks
// the wrong facet when the host process's C++ runtime differs, and crashes).
template <class T>
std::string str(T value) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(value));
    return buf;
  } else {
    return std::to_string(value);
  }
}

}  // namespace flash_msa
