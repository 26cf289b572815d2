# What setup.py needs to link the Python extension against this build: whether it has the CUDA
# kernels (with which nvcc, for which architectures) and the paths of the static libraries
# (written at generate time).
set(FLASH_MSA_BUILD_INFO "${PROJECT_BINARY_DIR}/flash_msa_build.json")
if(FLASH_MSA_HAS_CUDA)
  set(_flash_msa_cuda_lib "\"$<TARGET_FILE:flash_msa_cuda>\"")
  set(_flash_msa_has_cuda true)
  set(_flash_msa_cuda_version "${CMAKE_CUDA_COMPILER_VERSION}")
else()
  set(_flash_msa_cuda_lib null)
  set(_flash_msa_has_cuda false)
  set(_flash_msa_cuda_version "")
endif()
file(GENERATE OUTPUT "${FLASH_MSA_BUILD_INFO}" CONTENT "{
  \"cuda\": ${_flash_msa_has_cuda},
  \"cuda_version\": \"${_flash_msa_cuda_version}\",
  \"cuda_archs\": \"${FLASH_MSA_CUDA_ARCHS}\",
  \"cxx11_abi\": \"${FLASH_MSA_CXX11_ABI}\",
  \"core_library\": \"$<TARGET_FILE:flash_msa_core>\",
  \"cuda_library\": ${_flash_msa_cuda_lib}
}
")
