#!/usr/bin/env bash
# The Tinker protocol suite (pytest marker `tinker`) in its own cached environment: the real
# tinker 0.38 SDK and tinker-cookbook 0.6.1 driving `floe serve`.
#
# The environment lives under ${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}/tinker-<hash of the pins>
# and is reused while the pins below are unchanged. torch (CPU build) goes in first, then the
# SDK, then tinker-cookbook with --no-deps plus its other requirements (it declares
# tml-renderers>=0.4.1, which is not on the package index here and is only imported for
# Inkling / Kimi models), then floe itself in editable mode with its test extra.
# Usage: bash scripts/ci/tinker.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
TINKER_PIN="tinker==0.38.0"
COOKBOOK_PIN="tinker-cookbook==0.6.1"
EXCLUDED="tml-renderers torch"
PINS="$TORCH_PIN $TINKER_PIN $COOKBOOK_PIN excluded:$EXCLUDED py:$("$PY" -c 'import sys; print(sys.version_info[:2])')"
HASH=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
CACHE=${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}
VENV="$CACHE/tinker-$HASH"

if [ ! -f "$VENV/.complete" ]; then
  echo "tinker.sh: building $VENV ($PINS)"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip packaging
  "$VENV/bin/pip" install --quiet "$TORCH_PIN"
  "$VENV/bin/pip" install --quiet "$TINKER_PIN"
  "$VENV/bin/pip" install --quiet --no-deps "$COOKBOOK_PIN"
  # tinker-cookbook's own requirements, less the excluded ones.
  "$VENV/bin/python" - "$EXCLUDED" > "$VENV/cookbook-requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

excluded = set(sys.argv[1].split())
for line in requires("tinker-cookbook") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() not in excluded:
        print(line.split(";")[0].strip())
EOF
  "$VENV/bin/pip" install --quiet -r "$VENV/cookbook-requirements.txt"
  touch "$VENV/.complete"
fi
# .ci/run builds every stack's environment concurrently first (FLOE_CI_BUILD_ONLY=1); the build
# above touches nothing but $VENV, so those builds never collide.
if [ -n "${FLOE_CI_BUILD_ONLY:-}" ]; then exit 0; fi

"$VENV/bin/pip" install --quiet -e ".[test]"

"$VENV/bin/python" - <<'EOF'
import sys
import tinker, torch
if tinker.__version__ != "0.38.0":
    sys.exit(f"tinker.sh: tinker {tinker.__version__}, expected 0.38.0")
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"tinker.sh: torch {torch.__version__}, expected 2.13.0 (CPU build)")
EOF

export TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
start=$(date +%s)
"$VENV/bin/python" -m pytest -q -m tinker tests/tinker "$@"
echo "tinker.sh: suite took $(( $(date +%s) - start )) s"
