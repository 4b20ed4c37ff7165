#!/usr/bin/env bash
# Creates .venv with floe and its test tools. torch is pinned to the CPU build first so that
# pip never pulls a multi-GB CUDA wheel; floe itself accepts any recent torch a user brings.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.floe-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[test]"
touch "$stamp"
echo "floe installed in .venv"
