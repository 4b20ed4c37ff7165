#!/usr/bin/env bash
# CI only: the core suite's environment, cached like the stacks' (lib.sh) and keyed by
# pyproject.toml, linked in as this clone's .venv; only floe itself is installed again (editable,
# from this checkout). A clean clone's `make setup` would otherwise build .venv from nothing on
# every CI run (about 70 s). A developer's own checkout keeps its own .venv (scripts/setup.sh).
source "$(dirname "$0")/lib.sh"

if stack_env core "$TORCH_PIN $(sha256sum pyproject.toml | cut -c1-16)"; then
  "$VENV/bin/pip" install --quiet -e ".[test]" "$TORCH_PIN"
  stack_built
fi
if [ -e .venv ] && [ ! -L .venv ]; then
  echo "core-env.sh: .venv exists and is not a link; leaving it (scripts/setup.sh updates it)"; exit 0
fi
ln -sfn "$VENV" .venv
"$VENV/bin/pip" install --quiet --no-deps -e .
touch .venv/.floe-installed  # scripts/setup.sh's stamp: this install is current
echo "core-env.sh: .venv -> $VENV"
