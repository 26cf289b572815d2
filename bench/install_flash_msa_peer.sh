#!/usr/bin/env bash
# Installs the published Flash-MSA (PyPI flash-msa 0.1.1) and what it runs on from wheels into SITE,
# its package renamed flash_msa_peer: both projects name their package flash_msa, and under the
# other name Flash-MSA loads beside this library in one process (bench/against_flash_msa.py).
#
#   bash bench/install_flash_msa_peer.sh WHEELS SITE
#   export PYTHONPATH=SITE:SITE/nvidia_cutlass_dsl/dsl_packages   # the .pth of the DSL is not read
#                                                                 # from PYTHONPATH
# WHEELS holds, for CPython 3.12 on x86-64 (pip download --no-deps --only-binary=:all:):
# flash-msa==0.1.1, nvidia-cutlass-dsl==4.8.1 with nvidia-cutlass-dsl-libs-base, -libs-core and
# -libs-cu13 of 4.8.1, flash-attn-4==4.0.0b40 (Flash-MSA's forward runs FA4), quack-kernels==0.6.5,
# apache-tvm-ffi==0.1.15.post2 and einops. torch comes from the environment (Flash-MSA pins
# torch 2.12.0 in its metadata and runs on 2.11.0).
set -euo pipefail
wheels=$1 site=$2
rm -rf "$site"
# One pip call: the DSL's wheels share the folder nvidia_cutlass_dsl, which pip merges only
# within one installation.
python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
  --target "$site" "$wheels"/*.whl
mv "$site/flash_msa" "$site/flash_msa_peer"
grep -rlE --include='*.py' '\b(from|import) flash_msa\b' "$site/flash_msa_peer" |
  xargs -r sed -i -E 's/\b(from|import) flash_msa\b/\1 flash_msa_peer/g'
echo "install_flash_msa_peer: Flash-MSA installed as flash_msa_peer in $site"
