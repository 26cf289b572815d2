#!/usr/bin/env bash
# The main job: one MSA training step (select, sparse forward with KL, backward) with per-stage
# timings, on the GPU when the build has CUDA and a GPU is visible, else on the CPU.
# Arguments go to build/tools/msa_step (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x build/tools/msa_step ]]; then
  bash scripts/install_deps.sh
  bash scripts/build.sh
fi
exec build/tools/msa_step "$@"
