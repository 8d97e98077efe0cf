#!/usr/bin/env bash
# Build the GPU carry kit and dry-run it (issue 40): `bash scripts/gpu/pack.sh [--no-wheels]`.
# Writes .gpukit/run1..N (ignored) and checks every run's size and the GGUF join's hash; then see
# scripts/gpu/remote.sh for the device calls. Needs the network for the wheels (pip download) unless --no-wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
python scripts/gpu/kit.py pack "$@"
python scripts/gpu/kit.py check
