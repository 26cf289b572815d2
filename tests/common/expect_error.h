// EXPECT_MSA_ERROR(statement, "arg"[, "other_arg"...]): the statement throws flash_msa::Error whose
// message starts a clause "flash_msa: <arg>:" for one of the listed argument names (several are
// allowed only where the contract does not say which of two related fields is blamed).
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <initializer_list>
#include <string>

#include "flash_msa/msa.h"

namespace flash_msa::test {

template <class F>
::testing::AssertionResult throws_error_naming(F&& f, std::initializer_list<const char*> args) {
  try {
    f();
  } catch (const flash_msa::Error& e) {
    const std::string msg = e.what();
    for (const char* arg : args) {
      if (msg.find(std::string("flash_msa: ") + arg + ":") != std::string::npos)
        return ::testing::AssertionSuccess();
    }
    std::string want;
    for (const char* arg : args) want += std::string(want.empty() ? "" : " or ") + arg;
    return ::testing::AssertionFailure()
           << "flash_msa::Error names the wrong argument (want " << want << "): " << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-flash_msa::Error: " << e.what();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw a non-std exception";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace flash_msa::test

#define EXPECT_MSA_ERROR(statement, ...) \
  EXPECT_TRUE(::flash_msa::test::throws_error_naming([&] { statement; }, {__VA_ARGS__}))

#define EXPECT_MSA_OK(statement)                             \
  do {                                                       \
    try {                                                    \
      statement;                                             \
    } catch (const std::exception& e) {                      \
      ADD_FAILURE() << #statement << " threw: " << e.what(); \
    }                                                        \
  } while (0)
