#!/usr/bin/env bash
# Configures and builds the C++ library, the CLI and the tests into build/ (CUDA kernels too
# when nvcc is on the PATH, for FLASH_MSA_CUDA_ARCHS, default "80;90a;100a"). Extra arguments go
# to the CMake configure step; FLASH_MSA_TARGETS (e.g. "msa_step") limits what is built. Ninja
# rebuilds only what changed, so this is cheap when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${FLASH_MSA_JOBS:-${MAX_JOBS:-$(nproc)}}
generator=()
[[ -f build/CMakeCache.txt ]] || generator=(-G Ninja)
cmake -S . -B build "${generator[@]}" "$@"
targets=()
for target in ${FLASH_MSA_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build build -j "$jobs" "${targets[@]}"
