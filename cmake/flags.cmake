# Warnings for host code and the CUDA flags that surface register spills and local memory.
set(FLASH_MSA_CXX_WARNINGS -Wall -Wextra -Wno-unused-parameter)

# -gencode options for a list of architectures ("80;90a" -> sm_80 and sm_90a code).
function(flash_msa_gencode out archs)
  set(gencode "")
  foreach(arch IN LISTS archs)
    list(APPEND gencode "-gencode=arch=compute_${arch},code=sm_${arch}")
  endforeach()
  set(${out} "${gencode}" PARENT_SCOPE)
endfunction()

# CUDA flags of a target. Architectures are set per source file: every .cu file builds for all
# of FLASH_MSA_CUDA_ARCHS except the Hopper kernels (wgmma; any source under a folder named
# sm90), which build for sm_90a only. When the list has no 90a those still build, for its first
# entry, with empty kernel bodies (their #if guard): the launch code links against their symbols.
function(flash_msa_cuda_target target)
  if("90a" IN_LIST FLASH_MSA_CUDA_ARCHS)
    set(hopper_archs "90a")
  else()
    list(GET FLASH_MSA_CUDA_ARCHS 0 hopper_archs)
  endif()
  flash_msa_gencode(all_gencode "${FLASH_MSA_CUDA_ARCHS}")
  flash_msa_gencode(hopper_gencode "${hopper_archs}")
  get_target_property(sources ${target} SOURCES)
  get_target_property(source_dir ${target} SOURCE_DIR)
  foreach(source IN LISTS sources)
    if(NOT source MATCHES "\\.cu$")
      continue()
    endif()
    cmake_path(ABSOLUTE_PATH source BASE_DIRECTORY "${source_dir}" NORMALIZE OUTPUT_VARIABLE path)
    cmake_path(RELATIVE_PATH path BASE_DIRECTORY "${PROJECT_SOURCE_DIR}")
    if(path MATCHES "(^|/)sm90/")
      set(gencode ${hopper_gencode})
    else()
      set(gencode ${all_gencode})
    endif()
    set_source_files_properties(${source} TARGET_DIRECTORY ${target}
                                PROPERTIES COMPILE_OPTIONS "${gencode}")
  endforeach()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr
    -Xptxas=--warn-on-spills,--warn-on-local-memory-usage>)
  target_link_options(${target} PRIVATE $<$<LINK_LANGUAGE:CUDA>:${all_gencode}>)
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
                                             POSITION_INDEPENDENT_CODE ON)
endfunction()
