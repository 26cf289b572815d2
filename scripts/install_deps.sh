#!/usr/bin/env bash
# Installs the pinned build and test dependencies of flash-msa on Debian 12: the Debian packages
# system-wide (apt, as root or through sudo; only those missing), the Python packages into the
# project's own virtual environment .venv (created with --system-site-packages, so that a matching
# torch already installed for the system's python3 is reused rather than downloaded again). Nothing
# is pip-installed into the system's Python.
# The CUDA toolkit (nvcc 13.0) is optional: without it the CPU library and tests still build.
# --no-python: the Debian packages only (all that the C++ build needs).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(cmake ninja-build g++ libgtest-dev=1.12.1-0.2 googletest=1.12.1-0.2
              python3-venv python3-dev)
PY_PACKAGES=(torch==2.11.0 numpy==2.4.6 setuptools==81.0.0 wheel==0.48.0 ninja==1.13.2
             pytest==9.2.0 hypothesis==6.170.29  # the tests; hypothesis: tests/python/test_fuzz.py
             matplotlib==3.11.2  # the plots of examples/ and bench/report.py
             transformers==5.25.0  # flash_msa.hf and tests/python/test_hf*.py
             accelerate==1.15.0  # transformers.Trainer, in tests/python/test_hf_train.py
             nvidia-cuda-nvdisasm==13.5.37)  # scripts/compare_sass.py and its test

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "${pkg%%=*}" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [[ $(id -u) -eq 0 ]] || sudo_cmd="sudo"
  echo "install_deps: apt-get install ${missing[*]}"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q "${missing[@]}"
fi

[[ ${1:-} == --no-python ]] && exit 0
if [[ ! -x .venv/bin/python ]]; then
  echo "install_deps: creating the virtual environment .venv"
  python3 -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "${PY_PACKAGES[@]}"
