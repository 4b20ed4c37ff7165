#!/usr/bin/env bash
# The Tinker protocol suite (pytest marker `tinker`) in its own cached environment
# (scripts/ci/lib.sh): the real tinker 0.38 SDK and tinker-cookbook 0.6.1 driving `floe serve`.
#
# tinker-cookbook goes in with --no-deps plus its other requirements: it declares
# tml-renderers>=0.4.1, which is not on the package index here and is only imported for
# Inkling / Kimi models. Its `math-rl` extra (math-verify, pylatexenc, sympy) comes too: the
# math_rl recipe and rl_loop.py import its grader. Usage: bash scripts/ci/tinker.sh [extra pytest args]
source "$(dirname "$0")/lib.sh"

TINKER_PIN="tinker==0.38.0"
COOKBOOK_PIN="tinker-cookbook==0.6.1"
COOKBOOK_EXTRAS="math-rl"
EXCLUDED="tml-renderers torch"
if stack_env tinker "$TORCH_PIN $TINKER_PIN $COOKBOOK_PIN[$COOKBOOK_EXTRAS] excluded:$EXCLUDED"; then
  "$VENV/bin/pip" install --quiet "$TINKER_PIN"
  "$VENV/bin/pip" install --quiet --no-deps "$COOKBOOK_PIN"
  requirements_of tinker-cookbook "$EXCLUDED" $COOKBOOK_EXTRAS > "$VENV/cookbook-requirements.txt"
  "$VENV/bin/pip" install --quiet -r "$VENV/cookbook-requirements.txt"
  stack_built
fi
install_floe test
"$VENV/bin/python" -c "import sys, tinker; tinker.__version__ == '0.38.0' or sys.exit(
  f'tinker.sh: tinker {tinker.__version__}, expected 0.38.0')"

export TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# test_tinker_registry.py: raw-HTTP registry bounds, a server per test (kept out of the core suite's 10 minutes)
run_suite "$VENV/bin/python" -m pytest -q "${XDIST[@]}" -m tinker tests/tinker tests/server/test_tinker_registry.py "$@"
