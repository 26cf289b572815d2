#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, the C++ suites (GPU tests included), the per-stage
# kernel timings, the main job on the GPU, the cuDNN dense baseline, the Python package built with
# CUDA and its tests, and compute-sanitizer on the small GPU tests. Each phase has a time limit so
# that one slow phase cannot starve the rest.
#
#   PHASES="ctest pytest sanitizer" PYTEST_FILES="test_cuda.py test_fuzz.py" bash scripts/device_check.sh
#
# PHASES (default: all of ctest perf step dense pytest sanitizer) picks the phases, run in that
# order after the build, which always runs. FLASH_MSA_CUDA_ARCHS (default 90a: the
# Hopper machines; the portable kernels are built for it too) sets the build's architectures.
# PYTEST_FILES (default: every file under tests/python) limits the Python tests;
# FLASH_MSA_FUZZ_EXAMPLES raises the fuzz suite's examples. Logs go to $LOG_DIR (default
# ./device-logs); summary.txt collects the headlines.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${LOG_DIR:-device-logs}
mkdir -p "$log"
phases=" ${PHASES:-ctest perf step dense pytest sanitizer} "
# Golden cases: the repository's own (tests/golden) unless FLASH_MSA_GOLDEN_DIR names others.
golden_arg=()
[[ -n "${FLASH_MSA_GOLDEN_DIR:-}" ]] && golden_arg=(-DFLASH_MSA_GOLDEN_DIR="$FLASH_MSA_GOLDEN_DIR")
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 FLASH_MSA_CUDA_ARCHS=${FLASH_MSA_CUDA_ARCHS:-90a}
status=0
step() { echo "== $* ($(date +%T))" | tee -a "$log/summary.txt"; }
has() { [[ "$phases" == *" $1 "* ]]; }
tests=build/tests/flash_msa_cuda_tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log/summary.txt"

step "build (${FLASH_MSA_CUDA_ARCHS})"
{ cmake -S . -B build -G Ninja -DFLASH_MSA_CUDA_ARCHS="$FLASH_MSA_CUDA_ARCHS" "${golden_arg[@]}" &&
  cmake --build build -j "$MAX_JOBS"; } >"$log/build.txt" 2>&1 || { tail -50 "$log/build.txt"; exit 1; }
grep -E "spill|Local memory" "$log/build.txt" | sort -u | tee -a "$log/summary.txt"

if has pytest; then
  (FLASH_MSA_BUILD_DIR=$PWD/build python3 -m pip install -q --no-build-isolation --no-deps . \
     >"$log/pip.txt" 2>&1
   echo "pip rc $?" >>"$log/pip.txt") &
  pip_job=$!
fi

if has ctest; then
  step "ctest"
  timeout 240 ctest --test-dir build --output-on-failure -j 4 >"$log/ctest.txt" 2>&1 || status=1
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$log/ctest.txt" | tee -a "$log/summary.txt"
fi

if has perf; then
  step "kernel timings (paper heads, bf16)"
  FLASH_MSA_BENCH=1 timeout 90 $tests --gtest_also_run_disabled_tests --gtest_filter='*Perf*' \
    >"$log/perf.txt" 2>&1 || status=1
  grep -E "\[ perf \]|FAILED" "$log/perf.txt" | tee -a "$log/summary.txt"
fi

if has step; then
  step "main job on the GPU"
  for s in 32768 131072; do
    timeout 60 build/tools/msa_step --seqlen "$s" --iters 3 2>&1 | tee -a "$log/summary.txt" || status=1
  done
fi

if has dense; then
  step "cuDNN dense causal baseline"
  for s in 32768 131072; do
    timeout 45 python3 bench/dense_baseline.py --seqlen "$s" --iters 3 2>&1 | tee -a "$log/summary.txt"
  done
fi

if has pytest; then
  step "Python package with CUDA, pytest"
  wait $pip_job
  if grep -q "pip rc 0" "$log/pip.txt"; then
    (cd tests/python && timeout 420 python3 -m pytest -q -s -rfE -p no:cacheprovider ${PYTEST_FILES:-.}) \
      >"$log/pytest.txt" 2>&1 || status=1
    grep -E "^fuzz: " "$log/pytest.txt" | tee -a "$log/summary.txt"
    tail -15 "$log/pytest.txt" | tee -a "$log/summary.txt"
  else
    status=1
    tail -30 "$log/pip.txt" | tee -a "$log/summary.txt"
  fi
fi

if has sanitizer; then
  step "compute-sanitizer"
  for tool in memcheck racecheck; do
    echo "== $tool" >>"$log/sanitizer.txt"
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 1 $tests --gtest_brief=1 \
      --gtest_filter='*Schedule*:*Chunks*:*SparseForward*:*SparseBackward*:*docs*:*KlGrad*:*Indices*' \
      >"$log/$tool.tmp" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$log/$tool.tmp" | sed "s/^/$tool: /" |
      tee -a "$log/summary.txt"
    cat "$log/$tool.tmp" >>"$log/sanitizer.txt" && rm "$log/$tool.tmp"
  done
fi
step "done"
exit $status
