#!/usr/bin/env bash
# Set up AdaSpark from scratch in ./.venv (CPU torch wheel pinned), then fetch the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
# the native forward (C++ through torch's extension tooling); without a compiler the torch
# path runs and the engine says so in one line; with one, a failed build for this CPU fails here
.venv/bin/python -m adaspark.model.native.build
.venv/bin/adaspark fetch-model >/dev/null
