#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, run the C++ and Python suites there (GPU tests
# included), compute-sanitizer on small GPU tests, and the main job on the GPU. Logs go to
# $LOG_DIR (default ./device-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
log=${LOG_DIR:-device-logs}
mkdir -p "$log"
golden=${FLASH_MSA_GOLDEN_DIR:-$PWD/../shared/golden}
export MAX_JOBS=${MAX_JOBS:-16}
status=0
step() { echo "== $*" | tee -a "$log/summary.txt"; }

step "build"
{ cmake -S . -B build -G Ninja -DFLASH_MSA_GOLDEN_DIR="$golden" &&
  cmake --build build -j "$MAX_JOBS"; } >"$log/build.txt" 2>&1 || { tail -50 "$log/build.txt"; exit 1; }

step "ctest"
ctest --test-dir build --output-on-failure -j 4 >"$log/ctest.txt" 2>&1 || status=1
tail -5 "$log/ctest.txt" | tee -a "$log/summary.txt"

step "compute-sanitizer memcheck"
compute-sanitizer --tool memcheck --error-exitcode 1 build/tests/flash_msa_cuda_tests \
  --gtest_filter="${SANITIZE_FILTER:-*Small*}" >"$log/memcheck.txt" 2>&1 || status=1
tail -3 "$log/memcheck.txt" | tee -a "$log/summary.txt"

step "main job on the GPU"
build/tools/msa_step "${STEP_ARGS[@]:---seqlen 32768}" 2>&1 | tee "$log/step.txt" || status=1

step "pip install (CUDA) and pytest"
{ python3 -m pip install -q --no-build-isolation --no-deps . &&
  (cd tests/python && FLASH_MSA_GOLDEN_DIR="$golden" python3 -m pytest -q .); } \
  >"$log/pytest.txt" 2>&1 || status=1
tail -5 "$log/pytest.txt" | tee -a "$log/summary.txt"
exit $status
