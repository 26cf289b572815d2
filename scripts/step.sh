#!/usr/bin/env bash
# The main job: one MSA training step (select, sparse forward with KL, backward) with per-stage
# timings, on the GPU when the build has CUDA and a GPU is visible, else on the CPU.
# Arguments go to build/tools/msa_step (see --help). Installs the C++ build's dependencies and
# (re)builds the tool first, so that it never runs a stale binary; both return at once when
# everything is installed and up to date. Build messages go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh --no-python >&2
FLASH_MSA_TARGETS=msa_step bash scripts/build.sh >&2
exec build/tools/msa_step "$@"
