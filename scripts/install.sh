#!/usr/bin/env bash
# The whole set-up on a fresh machine: the CPU torch wheel first (a plain "torch" requirement
# would pull a multi-GB CUDA build), then spikeguard editable with every extra, OLMo-core with
# only what its import needs (scripts/install_olmo.sh), torchtitan without its heavy
# dependencies (scripts/install_torchtitan.sh), then Debian's Chromium for the browser tests
# (the diagnose report and the sandbox page).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[all]"
# OLMo-core without the CUDA torch its requirements would pull (about 20 s; see the script)
bash scripts/install_olmo.sh
# torchtitan for its integration tests (a few seconds: its own wheel and five small ones)
PYTHON="$PY" bash scripts/install_torchtitan.sh
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq chromium >/dev/null
fi
"$PY" -c "import torch, spikeguard; print(f'spikeguard {spikeguard.__version__} on torch {torch.__version__}')"
