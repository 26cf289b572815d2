# cmake -P tests/cmake/chip_folders_test.cmake: a chip folder registered with one entry of
# FLASH_MSA_CHIP_FOLDERS ("sm100=100a" here, a chip with no kernels yet) builds for its own
# architectures only, and nothing else changes (cmake/flags.cmake, flash_msa_archs_of).
cmake_minimum_required(VERSION 3.24)
include(${CMAKE_CURRENT_LIST_DIR}/../../cmake/flags.cmake)

function(expect path archs chips want)
  flash_msa_archs_of(got "${path}" "${archs}" "${chips}")
  if(NOT got STREQUAL want)
    message(SEND_ERROR "${path} with archs '${archs}', chips '${chips}': got '${got}', want '${want}'")
  endif()
endfunction()

set(all "80;90a;100a")
set(chips "sm90=90a;sm100=100a")
expect(src/cuda/forward/sm100/sparse.cu "${all}" "${chips}" "100a")
expect(src/cuda/forward/sm90/sparse.cu "${all}" "${chips}" "90a")
expect(src/cuda/forward/portable/sparse.cu "${all}" "${chips}" "${all}")
expect(src/cuda/forward/forward.cu "${all}" "${chips}" "${all}")
expect(src/cuda/forward/sm1000/x.cu "${all}" "${chips}" "${all}")  # a folder name, not a prefix
expect(src/cuda/forward/sm100/sparse.cu "80;90a" "${chips}" "80")  # no 100a: empty bodies
expect(src/cuda/select/sm90/select.cu "90a" "${chips}" "90a")
expect(tests/cuda/sm100/x.cu "${all}" "sm100=100a,103a" "100a")   # several architectures
expect(tests/cuda/sm100/x.cu "80;100a;103a" "sm100=100a,103a" "100a;103a")
# Without the entry the folder is an ordinary one.
expect(src/cuda/forward/sm100/sparse.cu "${all}" "sm90=90a" "${all}")
# The project's own registration.
expect(src/cuda/warmup/sm90/backward.cu "${all}" "${FLASH_MSA_CHIP_FOLDERS}" "90a")
