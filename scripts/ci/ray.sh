#!/usr/bin/env bash
# The Ray placement suite (pytest marker `ray`) in its own cached environment (scripts/ci/lib.sh).
#
# Ray is an optional stack (the `ray` extra): floe's core suite never imports it. The suite starts
# ONE local Ray cluster per session (tests/ray/conftest.py) with more logical CPUs than this
# machine has cores, so a policy of 2 ranks, 2 sampler replicas and a reference actor fit.
# Usage: bash scripts/ci/ray.sh [extra pytest args]
source "$(dirname "$0")/lib.sh"

RAY_PIN="ray[default]==2.60.0"
if stack_env ray "$TORCH_PIN $RAY_PIN"; then
  "$VENV/bin/pip" install --quiet "$RAY_PIN" "$TORCH_PIN"
  stack_built
fi
install_floe test,ray

# Two cores shared: every actor keeps torch to one thread (placement sets it per actor too), and
# Ray's dashboard and usage reporting stay off.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export RAY_USAGE_STATS_ENABLED=0
run_suite timeout -k 60 1200 "$VENV/bin/python" -m pytest -q -m ray tests/ray "$@"
