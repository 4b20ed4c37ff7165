# Sourced by scripts/ci/<stack>.sh: the one way a stack suite gets its cached environment.
#
# An environment lives under ${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}/<stack>-<hash of its pins and
# the Python version> and is reused while they are unchanged; `.complete` marks a finished build.
# A build writes nothing outside its own directory, so .ci/run builds every stack concurrently
# (FLOE_CI_BUILD_ONLY=1) while the core suite runs. torch is always the CPU build 2.13.0 from
# local disk, installed first and re-pinned on every later install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"

# stack_env NAME PINS: sets STACK, PINS and VENV. Succeeds (after creating a fresh venv holding
# pip, packaging and torch) when the environment must be built; fails when it is cached.
stack_env() {
  STACK=$1
  PINS="$2 py:$("$PY" -c 'import sys; print(sys.version_info[:2])')" || exit 1
  VENV="${FLOE_CI_CACHE:-$HOME/.cache/floe-ci}/$STACK-$(printf '%s' "$PINS" | sha256sum | cut -c1-12)"
  [ -f "$VENV/.complete" ] && return 1
  echo "${0##*/}: building $VENV ($PINS)"
  STACK_T0=$(date +%s)
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  # `|| exit 1`: a function called as an `if` condition runs without set -e.
  "$PY" -m venv "$VENV" || exit 1
  "$VENV/bin/pip" install --quiet --upgrade pip packaging || exit 1
  "$VENV/bin/pip" install --quiet "$TORCH_PIN" || exit 1
}

# stack_built: mark the environment complete (after the stack's own build steps).
stack_built() {
  touch "$VENV/.complete"
  echo "${0##*/}: environment built in $(( $(date +%s) - STACK_T0 )) s"
}

# requirements_of DIST EXCLUDED [EXTRA ...]: DIST's requirements for this platform (base, plus
# the given extras), less the space-separated EXCLUDED names, one per line.
requirements_of() {
  "$VENV/bin/python" - "$@" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

dist, excluded, extras = sys.argv[1], set(sys.argv[2].split()), ["", *sys.argv[3:]]
for line in requires(dist) or []:
    req = Requirement(line)
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
        continue
    if req.name.lower() not in excluded:
        print(line.split(";")[0].strip())
PYEOF
}

# install_floe EXTRAS: exits here under FLOE_CI_BUILD_ONLY; otherwise floe from this checkout
# (editable) with the given extras, torch kept at its pin, and a check that torch is still it.
# One install at a time (a lock beside the environments): an editable install writes the
# checkout's src/floe.egg-info, and .ci/run runs two suites side by side.
install_floe() {
  if [ -n "${FLOE_CI_BUILD_ONLY:-}" ]; then exit 0; fi
  (
    flock 9
    "$VENV/bin/pip" install --quiet -e ".[$1]" "$TORCH_PIN"
  ) 9> "$(dirname "$VENV")/.install-floe.lock"
  "$VENV/bin/python" -c "import sys, torch; torch.__version__.startswith('2.13.0') or sys.exit(
    f'${0##*/}: torch {torch.__version__}, expected 2.13.0 (CPU build)')"
}

# XDIST: pytest's arguments for two pytest-xdist workers, one test file each at a time (a module's
# fixtures built once), as `make test` runs the core suite. For the suites whose runs mostly wait on
# process start-ups, imports and servers: one verl stock-recipe run keeps 1.15 of the 2 cores busy
# on average. pytest's clock, one worker -> two: verl 805-878 -> 613 s, tinker 334 -> 196 s, SkyRL
# 307 -> 263 s, prime-rl 203 -> 168 s once its two stock-recipe launches sat in two files
# (README "## Tests"). Not Ray: CPU-bound (384 s against 382-417 s). Not `--dist loadgroup`: pytest
# 9.2 no longer reads the node ids that xdist 3.8 rewrites for its xdist_group marks, so they group nothing.
XDIST=(-n 2 --dist loadfile)

# run_suite COMMAND...: run the stack's pytest command, its ten slowest tests listed (where CI's
# time goes), and say how long it took.
run_suite() {
  local start
  start=$(date +%s)
  "$@" --durations=10
  echo "${0##*/}: suite took $(( $(date +%s) - start )) s"
}
