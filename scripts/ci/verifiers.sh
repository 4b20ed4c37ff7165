#!/usr/bin/env bash
# The verifiers / prime-rl suite (pytest marker `verifiers`) in its own cached environment
# (scripts/ci/lib.sh).
#
# verifiers 0.4.0 (prime-rl's environment and client layer) pulls openai>=2.54, mcp, the
# prime-* SDKs and renderers: too heavy and too pinned for floe's .venv. The suite drives a
# `floe serve` process on loopback with verifiers' real TrainClient (token-in/token-out
# /inference/v1/generate) and EvalClient (/v1/chat/completions) through multi-turn rollouts,
# directly and inside a full verifiers environment (tests/integrations/prime_rl/floe_count_env.py).
# Usage: bash scripts/ci/verifiers.sh [extra pytest args]
source "$(dirname "$0")/lib.sh"

VF_PINS="verifiers==0.4.0 msgspec"
if stack_env verifiers "$TORCH_PIN $VF_PINS"; then
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install --quiet $VF_PINS "$TORCH_PIN"
  stack_built
fi
install_floe test,prime-rl
"$VENV/bin/python" -c "import sys, verifiers.v1; from importlib.metadata import version
version('verifiers') == '0.4.0' or sys.exit(f\"verifiers.sh: verifiers {version('verifiers')}, expected 0.4.0\")"

# Two cores shared: few threads; nothing reaches a hub.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
run_suite timeout -k 60 1800 "$VENV/bin/python" -m pytest -q -m verifiers tests/integrations/prime_rl "$@"
