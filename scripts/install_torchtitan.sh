#!/usr/bin/env bash
# torchtitan for spikeguard's torchtitan integration tests, on the CPU torch that
# scripts/install.sh pinned. torchtitan 0.3.0 is installed without its dependencies: they would
# pull datasets (with pyarrow and pandas, about 400 MB, and a huggingface-hub older than the one
# transformers uses), wandb and another torch; only the small pure-Python packages that its
# Trainer, debug model and DCP checkpointer import are added, and the two that its modules import
# at load time with their own dependencies (tensorboard: torchtitan.components.metrics;
# tokenizers: torchtitan.components.tokenizer). spikeguard.integrations.torchtitan_cpu covers
# the imports left out (datasets, which the llama3 registry imports, and triton) and
# docs/torchtitan.md says why.
# On a GPU machine, `pip install "spikeguard[torchtitan]"` installs torchtitan as it asks.
# Offline (a machine that reaches no package index, such as a lent GPU machine): first
# `WHEELS=wheels bash scripts/install_torchtitan.sh --download` where an index is reachable,
# carry the folder, then `WHEELS=wheels bash scripts/install_torchtitan.sh` installs from it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PKGS=("torchtitan==0.3.0" "torchdata==0.11.0" "tyro==1.0.17" "docstring-parser==0.18.0"
      "typeguard==4.6.1" "spmd-types==0.2.3")
WITH_DEPS=("tensorboard==2.21.0" "tokenizers==0.23.3")  # neither depends on torch
if [ "${1:-}" = "--download" ]; then
  "$PY" -m pip download --quiet --no-deps --dest "${WHEELS:?set WHEELS=folder}" "${PKGS[@]}"
  "$PY" -m pip download --quiet --dest "$WHEELS" "${WITH_DEPS[@]}"
  exit 0
fi
FROM=()
if [ -n "${WHEELS:-}" ]; then FROM=(--no-index --find-links "$WHEELS"); fi
"$PY" -m pip install --quiet --no-deps "${FROM[@]}" "${PKGS[@]}"
"$PY" -m pip install --quiet "${FROM[@]}" "${WITH_DEPS[@]}"
"$PY" -c "import importlib.metadata as m; print('torchtitan', m.version('torchtitan'))"
