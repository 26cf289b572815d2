#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, run the C++ suites (GPU tests included),
# compute-sanitizer on small GPU tests, the per-stage kernel timings, the main job on the GPU,
# the cuDNN dense baseline, and the Python package built with CUDA and its tests.
# Logs go to $LOG_DIR (default ./device-logs); summary.txt collects the headlines.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${LOG_DIR:-device-logs}
mkdir -p "$log"
golden=${FLASH_MSA_GOLDEN_DIR:-$PWD/../shared/golden}
export MAX_JOBS=${MAX_JOBS:-16}
status=0
step() { echo "== $*" | tee -a "$log/summary.txt"; }
tests=build/tests/flash_msa_cuda_tests

step "build"
{ cmake -S . -B build -G Ninja -DFLASH_MSA_GOLDEN_DIR="$golden" &&
  cmake --build build -j "$MAX_JOBS"; } >"$log/build.txt" 2>&1 || { tail -50 "$log/build.txt"; exit 1; }

(python3 -m pip install -q --no-build-isolation --no-deps . >"$log/pip.txt" 2>&1; echo $? >"$log/pip.rc") &
pip_job=$!

step "ctest"
ctest --test-dir build --output-on-failure -j 4 >"$log/ctest.txt" 2>&1 || status=1
grep -E "tests passed|tests failed|\(Failed\)" "$log/ctest.txt" | tee -a "$log/summary.txt"

step "compute-sanitizer"
for tool in memcheck racecheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 1 $tests --gtest_brief=1 \
    --gtest_filter='*docs*:*ragged*:*varlen*:*KlGrad*:*Determinism*:*Indices*' \
    >"$log/$tool.txt" 2>&1 || status=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$log/$tool.txt" | sed "s/^/$tool: /" |
    tee -a "$log/summary.txt"
done

step "kernel timings (paper heads, bf16)"
FLASH_MSA_BENCH=1 $tests --gtest_also_run_disabled_tests --gtest_filter='*Perf*' \
  >"$log/perf.txt" 2>&1 || status=1
grep -iE "TFLOP|ms" "$log/perf.txt" | tee -a "$log/summary.txt"

step "main job on the GPU"
build/tools/msa_step --seqlen 32768 2>&1 | tee -a "$log/summary.txt" || status=1
build/tools/msa_step --seqlen 131072 --iters 3 2>&1 | tee -a "$log/summary.txt" || status=1

step "cuDNN dense causal baseline"
for s in 32768 131072; do
  python3 bench/dense_baseline.py --seqlen "$s" --iters 3 2>&1 | tee -a "$log/summary.txt"
done

step "Python package with CUDA, pytest"
wait $pip_job
if [[ $(cat "$log/pip.rc") == 0 ]]; then
  (cd tests/python && FLASH_MSA_GOLDEN_DIR="$golden" python3 -m pytest -q . -p no:cacheprovider) \
    >"$log/pytest.txt" 2>&1 || status=1
  tail -15 "$log/pytest.txt" | tee -a "$log/summary.txt"
else
  status=1
  tail -30 "$log/pip.txt" | tee -a "$log/summary.txt"
fi
exit $status
