#!/usr/bin/env bash
# The verifiers / prime-rl suite (pytest marker `verifiers`) in its own cached environment.
#
# verifiers 0.4.0 (prime-rl's environment and client layer) pulls openai>=2.54, mcp, the
# prime-* SDKs and renderers: too heavy and too pinned for floe's .venv. The environment lives
# under ${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}/verifiers-<hash of the pins> and is reused while the
# pins below are unchanged: CPU torch 2.13.0 first, then verifiers and msgspec (floe's `prime-rl`
# extra), then floe itself in editable mode. The suite drives a `floe serve` process on loopback
# with verifiers' real TrainClient (token-in/token-out /inference/v1/generate) and EvalClient
# (/v1/chat/completions) through multi-turn rollouts of a verifiers environment.
# Usage: bash scripts/ci/verifiers.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
VF_PINS="verifiers==0.4.0 msgspec"
PINS="$TORCH_PIN $VF_PINS py:$("$PY" -c 'import sys; print(sys.version_info[:2])')"
HASH=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
CACHE=${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}
VENV="$CACHE/verifiers-$HASH"

if [ ! -f "$VENV/.complete" ]; then
  echo "verifiers.sh: building $VENV ($PINS)"
  t0=$(date +%s)
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "$TORCH_PIN"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install --quiet $VF_PINS "$TORCH_PIN"
  touch "$VENV/.complete"
  echo "verifiers.sh: environment built in $(( $(date +%s) - t0 )) s"
fi
# .ci/run builds every stack's environment concurrently first (FLOE_CI_BUILD_ONLY=1); the build
# above touches nothing but $VENV, so those builds never collide.
if [ -n "${FLOE_CI_BUILD_ONLY:-}" ]; then exit 0; fi

# floe itself (editable) with its test tools and the prime-rl extra (satisfied after the first run).
"$VENV/bin/pip" install --quiet --no-deps -e .
"$VENV/bin/pip" install --quiet -e ".[test,prime-rl]" "$TORCH_PIN"
"$VENV/bin/python" - <<'PYEOF'
import sys
from importlib.metadata import version
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"verifiers.sh: torch {torch.__version__}, expected 2.13.0 (CPU build)")
if version("verifiers") != "0.4.0":
    sys.exit(f"verifiers.sh: verifiers {version('verifiers')}, expected 0.4.0")
import verifiers.v1  # noqa: F401
print("verifiers.sh: verifiers 0.4.0 imports")
PYEOF

# Two cores shared: few threads; nothing reaches a hub.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)
timeout -k 60 1800 "$VENV/bin/python" -m pytest -q -m verifiers tests/integrations/prime_rl "$@"
echo "verifiers.sh: suite took $(( $(date +%s) - start )) s"
