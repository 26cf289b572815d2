#!/usr/bin/env bash
# The project's test command: installs pinned dependencies, builds, runs the C++ tests (ctest)
# and the Python tests (pytest). GPU tests run where a GPU is visible and skip elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

bash scripts/install_deps.sh
bash scripts/build.sh -DFLASH_MSA_TESTS=ON
ctest --test-dir build --output-on-failure -j "$MAX_JOBS"

python3 -m pip install -q --no-build-isolation --disable-pip-version-check .
cd tests/python  # import the installed package, not the source folder
python3 -m pytest -q .
