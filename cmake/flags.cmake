# Warnings for host code and the CUDA flags that surface register spills and local memory.
set(FLASH_MSA_CXX_WARNINGS -Wall -Wextra -Wno-unused-parameter)

function(flash_msa_cuda_target target)
  set(gencode "")
  foreach(arch IN LISTS FLASH_MSA_CUDA_ARCHS)
    list(APPEND gencode "-gencode=arch=compute_${arch},code=sm_${arch}")
  endforeach()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:${gencode} -lineinfo --expt-relaxed-constexpr
    -Xptxas=--warn-on-spills,--warn-on-local-memory-usage>)
  target_link_options(${target} PRIVATE $<$<LINK_LANGUAGE:CUDA>:${gencode}>)
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
                                             POSITION_INDEPENDENT_CODE ON)
endfunction()
