#!/usr/bin/env bash
# The whole set-up on a fresh machine: the CPU torch wheel first (a plain "torch" requirement
# would pull a multi-GB CUDA build), then spikeguard editable with every extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[all]"
"$PY" -c "import torch, spikeguard; print(f'spikeguard {spikeguard.__version__} on torch {torch.__version__}')"
