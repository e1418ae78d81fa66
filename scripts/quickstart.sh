#!/usr/bin/env bash
# Quickstart on a fresh Debian machine like the project's CI (root, no public
# Docker registry, PyPI and Debian reachable): start a Docker engine, local
# registries and base images, install imagefactory, fetch torch's CPU wheel into
# examples/wheels/, then build and smoke-test examples/matrix.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/ci-setup.sh
python3 -m pip install -q -e .
mkdir -p examples/wheels
if ! compgen -G "examples/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    python3 -m pip download -q --no-deps -d examples/wheels "torch==2.13.0+cpu"
fi
imagefactory list --matrix examples/matrix.yaml
exec imagefactory build --matrix examples/matrix.yaml --report build/report.json "$@"
