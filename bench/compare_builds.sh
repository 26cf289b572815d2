#!/usr/bin/env bash
# Compares two versions of the CUDA library on a GPU: builds each one's libraries, links
# bench/compare_builds.cc against both, diffs the bitwise digests of every output (default
# kernels and, at the paper shape, the portable ones) and times both in turn, three times, at 32K
# and 128K. The builds are for FLASH_MSA_CUDA_ARCHS (default 90a: H100/H200).
#   bash bench/compare_builds.sh OLD_SOURCE_DIR [NEW_SOURCE_DIR (default: this checkout)]
# e.g. OLD_SOURCE_DIR from `git worktree add /tmp/old REV`. Logs and results go to $OUT_DIR
# (default ./compare-logs); exit status 1 when the digests differ.
set -uo pipefail
old=$(realpath "$1")
new=$(realpath "${2:-$(dirname "$0")/..}")
here=$(realpath "$(dirname "$0")")
out=${OUT_DIR:-compare-logs}
mkdir -p "$out"
jobs=${FLASH_MSA_JOBS:-$(nproc)}

build() {  # source dir, build dir, log
  cmake -S "$1" -B "$2" -G Ninja -DFLASH_MSA_TESTS=OFF \
    -DFLASH_MSA_CUDA_ARCHS="${FLASH_MSA_CUDA_ARCHS:-90a}" >"$3" 2>&1 &&
    cmake --build "$2" -j "$jobs" --target flash_msa_cuda flash_msa_core >>"$3" 2>&1
}
link() {  # source dir, build dir, program
  nvcc -std=c++20 -O2 "$here/compare_builds.cc" -I "$1/include" \
    "$(find "$2/src" -name libflash_msa_cuda.a)" "$(find "$2/src" -name libflash_msa_core.a)" \
    -lpthread -o "$3"
}
for side in old new; do
  src=${!side}
  build "$src" "$out/build-$side" "$out/build-$side.log" || { tail -20 "$out/build-$side.log"; exit 2; }
  link "$src" "$out/build-$side" "$out/compare-$side" || exit 2
done
for side in old new; do
  "$out/compare-$side" >"$out/digests-$side.txt"
  FLASH_MSA_PORTABLE_KERNELS=1 "$out/compare-$side" digest paper32k | sed 's/^/portable /' \
    >>"$out/digests-$side.txt"
done
status=0
if diff "$out/digests-old.txt" "$out/digests-new.txt"; then
  echo "digests identical ($(grep -c . "$out/digests-new.txt") lines)"
else
  echo "digests differ"
  status=1
fi
for run in 1 2 3; do
  for shape in paper32k paper128k; do
    for side in old new; do
      "$out/compare-$side" time $shape 2>&1 >/dev/null | sed "s/^/$side run $run: /"
    done
  done
done | tee "$out/timing.txt"
exit $status
