// Where the golden cases are (SPEC "Golden cases") and which ones are there. The build unpacks
// the in-repo copy (tests/golden/golden.tar.xz) into its tree and compiles that directory in as
// FLASH_MSA_GOLDEN_DIR; the environment variable of the same name overrides it at run time. A
// missing or empty directory is no error here: the golden tests skip and say why.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace flash_msa::test {

inline std::filesystem::path golden_dir() {
  if (const char* env = std::getenv("FLASH_MSA_GOLDEN_DIR"); env != nullptr && *env != '\0')
    return env;
#ifdef FLASH_MSA_GOLDEN_DIR
  return FLASH_MSA_GOLDEN_DIR;
#else
  return {};
#endif
}

// Whether golden_dir()/name/meta.json exists.
inline bool golden_case_present(const std::string& name) {
  std::error_code ec;
  return std::filesystem::is_regular_file(golden_dir() / name / "meta.json", ec);
}

// The sorted names of the case_* directories that hold a meta.json; empty, never an exception,
// when the directory is missing or unreadable (this runs while tests are being registered).
inline std::vector<std::string> golden_case_names() {
  std::vector<std::string> names;
  std::error_code ec;
  std::filesystem::directory_iterator it(golden_dir(), ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("case_", 0) == 0 && golden_case_present(name)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The skip message of a golden test that finds no cases.
inline std::string golden_missing_reason() {
  return "no golden cases (case_*/meta.json) in '" + golden_dir().string() +
         "': the build unpacks them from tests/golden/golden.tar.xz; FLASH_MSA_GOLDEN_DIR (CMake "
         "option or environment variable) points elsewhere, e.g. at ../shared/golden";
}

}  // namespace flash_msa::test
