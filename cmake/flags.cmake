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

# Chip folders: "<folder>=<architectures>" pairs. A CUDA source under a folder of that name (at
# any depth) holds kernels that use that chip's own instructions and builds for those
# architectures only; every other source builds for all of FLASH_MSA_CUDA_ARCHS. A new chip
# joins with its folders and one entry here, e.g. "sm100=100a". Where the build's list holds none
# of a folder's architectures, its sources still build, for the list's first entry, with empty
# kernel bodies (their #if guard): the launch code links against their symbols.
set(FLASH_MSA_CHIP_FOLDERS "sm90=90a" CACHE STRING "chip folders and their architectures")

# The architectures a source at `path` (relative to the project) builds for, given the build's
# list `archs` and the chip folders `chips`.
function(flash_msa_archs_of out path archs chips)
  foreach(entry IN LISTS chips)
    string(REPLACE "=" ";" pair "${entry}")
    list(GET pair 0 folder)
    list(GET pair 1 chip_archs)
    string(REPLACE "," ";" chip_archs "${chip_archs}")
    if(path MATCHES "(^|/)${folder}/")
      set(kept "")
      foreach(arch IN LISTS chip_archs)
        if(arch IN_LIST archs)
          list(APPEND kept ${arch})
        endif()
      endforeach()
      if(NOT kept)
        list(GET archs 0 kept)
      endif()
      set(${out} "${kept}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()

# CUDA flags of a target. Architectures are set per source file (flash_msa_archs_of).
function(flash_msa_cuda_target target)
  flash_msa_gencode(all_gencode "${FLASH_MSA_CUDA_ARCHS}")
  get_target_property(sources ${target} SOURCES)
  get_target_property(source_dir ${target} SOURCE_DIR)
  foreach(source IN LISTS sources)
    if(NOT source MATCHES "\\.cu$")
      continue()
    endif()
    cmake_path(ABSOLUTE_PATH source BASE_DIRECTORY "${source_dir}" NORMALIZE OUTPUT_VARIABLE path)
    cmake_path(RELATIVE_PATH path BASE_DIRECTORY "${PROJECT_SOURCE_DIR}")
    flash_msa_archs_of(archs "${path}" "${FLASH_MSA_CUDA_ARCHS}" "${FLASH_MSA_CHIP_FOLDERS}")
    flash_msa_gencode(gencode "${archs}")
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
