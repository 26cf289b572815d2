# FLASH_MSA_CXX11_ABI: the _GLIBCXX_USE_CXX11_ABI value the libraries must use. The define is
# added only where it differs from the compiler's default, so that asking for the default value
# (as the Python build does) leaves every compile command, and so the build, unchanged.
set(FLASH_MSA_ABI_DEFINITIONS "")
if(NOT FLASH_MSA_CXX11_ABI STREQUAL "")
  if(NOT FLASH_MSA_CXX11_ABI MATCHES "^[01]$")
    message(FATAL_ERROR "FLASH_MSA_CXX11_ABI must be 0, 1 or empty, got ${FLASH_MSA_CXX11_ABI}")
  endif()
  include(CheckCXXSourceCompiles)
  check_cxx_source_compiles("
    #include <string>
    #if !defined(_GLIBCXX_USE_CXX11_ABI) || _GLIBCXX_USE_CXX11_ABI != ${FLASH_MSA_CXX11_ABI}
    #error other ABI
    #endif
    int main() { return 0; }" FLASH_MSA_CXX11_ABI_${FLASH_MSA_CXX11_ABI}_IS_DEFAULT)
  if(NOT FLASH_MSA_CXX11_ABI_${FLASH_MSA_CXX11_ABI}_IS_DEFAULT)
    set(FLASH_MSA_ABI_DEFINITIONS _GLIBCXX_USE_CXX11_ABI=${FLASH_MSA_CXX11_ABI})
    message(STATUS "flash-msa: libraries built with _GLIBCXX_USE_CXX11_ABI=${FLASH_MSA_CXX11_ABI}")
  endif()
endif()
