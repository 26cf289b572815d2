#!/usr/bin/env bash
# The project's test command: installs pinned dependencies (Python ones into .venv), builds the
# C++ once into build/, runs the C++ tests (ctest), then builds the Python extension against that
# same build (setup.py compiles only the bindings in python/csrc) into .venv and runs the Python
# tests (pytest). GPU tests run where a GPU is visible and skip elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
python=$PWD/.venv/bin/python

bash scripts/install_deps.sh
bash scripts/build.sh -DFLASH_MSA_TESTS=ON
ctest --test-dir build --output-on-failure -j "$MAX_JOBS"

FLASH_MSA_BUILD_DIR=$PWD/build "$python" -m pip install -q --no-build-isolation --no-deps \
  --disable-pip-version-check .
cd tests/python  # import the installed package, not the source folder
"$python" -m pytest -q .
