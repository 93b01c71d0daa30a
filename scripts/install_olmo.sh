#!/usr/bin/env bash
# OLMo-core for spikeguard.integrations.olmo_core (tests/test_integrations_olmo.py), without the
# CUDA torch its own requirements would pull: ai2-olmo-core --no-deps, then only what importing
# olmo_core.train needs, each --no-deps (torch, numpy, requests, rich, PyYAML, safetensors,
# packaging, filelock, huggingface-hub come with spikeguard's other extras).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --no-deps "ai2-olmo-core==3.0.0" \
  "bettermap==1.3.1" "dill==0.4.1" "dataclass-extensions==0.5.0" "importlib_resources==7.1.0" \
  "cached-path==1.8.10" "google-cloud-storage==3.17.1" "google-api-core==2.44.0" \
  "google-auth==2.63.0" "google-cloud-core==2.8.0" "google-resumable-media==2.11.0" \
  "google-crc32c==1.9.0" "proto-plus==1.29.0" "googleapis-common-protos>=1.56" \
  "boto3" "botocore" "s3transfer" "jmespath"
