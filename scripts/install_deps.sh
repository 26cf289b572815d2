#!/usr/bin/env bash
# Installs the pinned build and test dependencies of flash-msa on Debian 12 (root or sudo).
# The CUDA toolkit (nvcc 13.0) is optional: without it the CPU library and tests still build.
set -euo pipefail

APT_PACKAGES=(cmake ninja-build g++ libgtest-dev=1.12.1-0.2 googletest=1.12.1-0.2)
PY_PACKAGES=(torch==2.11.0 numpy==2.4.6 pytest==9.2.0 setuptools==81.0.0 wheel==0.48.0 ninja==1.13.2)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "${pkg%%=*}" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [[ $(id -u) -eq 0 ]] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q "${missing[@]}"
fi

python3 -m pip install -q --disable-pip-version-check "${PY_PACKAGES[@]}"
