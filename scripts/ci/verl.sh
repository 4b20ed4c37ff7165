#!/usr/bin/env bash
# The verl plugin suite (pytest marker `verl`) in its own cached environment.
#
# verl 0.9.1 pins transformers < 5.11 and needs TransferQueue for its V1 trainer, so it cannot
# share floe's .venv. The environment lives under
# ${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}/verl-<hash of the pins> and is reused while the pins
# below are unchanged. torch (CPU build) goes in first, then verl and the pieces of its
# `verl-core` extra that the V1 trainer imports, then floe itself in editable mode.
# The suite runs verl's real `python -m verl.trainer.main_ppo` (3 GRPO steps with validation,
# embedded and against `floe serve` on loopback) and the loss-equivalence test.
# Usage: bash scripts/ci/verl.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
VERL_PINS="verl==0.9.1 TransferQueue==0.1.11 pyzmq msgspec cachetools mathruler pyarrow pandas"
PINS="$TORCH_PIN $VERL_PINS py:$("$PY" -c 'import sys; print(sys.version_info[:2])')"
HASH=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
CACHE=${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}
VENV="$CACHE/verl-$HASH"

if [ ! -f "$VENV/.complete" ]; then
  echo "verl.sh: building $VENV ($PINS)"
  t0=$(date +%s)
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "$TORCH_PIN"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install --quiet $VERL_PINS
  touch "$VENV/.complete"
  echo "verl.sh: environment built in $(( $(date +%s) - t0 )) s"
fi
# .ci/run builds every stack's environment concurrently first (FLOE_CI_BUILD_ONLY=1); the build
# above touches nothing but $VENV, so those builds never collide.
if [ -n "${FLOE_CI_BUILD_ONLY:-}" ]; then exit 0; fi

# floe itself (editable) with its test tools, then the checks that verl's own loader finds the plugin.
"$VENV/bin/pip" install --quiet --no-deps -e .
"$VENV/bin/pip" install --quiet -e ".[test]"
"$VENV/bin/python" - <<'PYEOF'
import sys
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"verl.sh: torch {torch.__version__}, expected 2.13.0 (CPU build)")
import verl  # loads the `verl.plugins` entry points: no VERL_USE_EXTERNAL_MODULES needed
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.workers.rollout.replica import RolloutReplicaRegistry
assert get_trainer_cls("floe").__module__ == "floe.integrations.verl.plugin"
assert RolloutReplicaRegistry.get("floe").__module__ == "floe.integrations.verl.plugin"
print(f"verl.sh: verl {verl.__version__}: trainer mode 'floe' and rollout 'floe' registered")
PYEOF

# Two cores shared: keep torch to few threads in every process verl starts.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)
# The whole suite runs under an outer timeout as well (each verl run has its own).
timeout -k 60 2700 "$VENV/bin/python" -m pytest -q -s -m verl tests/integrations/verl "$@"
echo "verl.sh: suite took $(( $(date +%s) - start )) s"
