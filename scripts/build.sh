#!/usr/bin/env bash
# Configures and builds the C++ library, the CLI and the tests into build/ (CUDA kernels too
# when nvcc is on the PATH). Extra arguments go to the CMake configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${FLASH_MSA_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja "$@"
cmake --build build -j "$jobs"
