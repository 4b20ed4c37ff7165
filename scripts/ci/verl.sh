#!/usr/bin/env bash
# The verl plugin suite (pytest marker `verl`) in its own cached environment (scripts/ci/lib.sh).
#
# verl 0.9.1 pins transformers < 5.11 and needs TransferQueue for its V1 trainer, so it cannot
# share floe's .venv. The suite runs verl's real `python -m verl.trainer.main_ppo` (3 GRPO steps
# with validation, embedded and against `floe serve` on loopback) and the loss-equivalence test.
# Usage: bash scripts/ci/verl.sh [extra pytest args]
source "$(dirname "$0")/lib.sh"

VERL_PINS="verl==0.9.1 TransferQueue==0.1.11 pyzmq msgspec cachetools mathruler pyarrow pandas"
if stack_env verl "$TORCH_PIN $VERL_PINS"; then
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install --quiet $VERL_PINS
  stack_built
fi
install_floe test
"$VENV/bin/python" - <<'PYEOF'
import verl  # loads the `verl.plugins` entry points: no VERL_USE_EXTERNAL_MODULES needed
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.workers.rollout.replica import RolloutReplicaRegistry
assert get_trainer_cls("floe").__module__ == "floe.integrations.verl.plugin"
assert RolloutReplicaRegistry.get("floe").__module__ == "floe.integrations.verl.plugin"
from verl.experimental.one_step_off_policy import ray_trainer  # its entrypoint builds this name
assert ray_trainer.OneStepOffRayTrainer.__module__ == "floe.integrations.verl.one_step"
from verl.experimental.fully_async_policy import fully_async_rollouter, fully_async_trainer  # its entrypoint's names
assert type(fully_async_trainer.FullyAsyncTrainer).__module__ == "floe.integrations.verl.fully_async"
assert type(fully_async_rollouter.FullyAsyncRollouter).__module__ == "floe.integrations.verl.fully_async"
print(f"verl.sh: verl {verl.__version__}: trainer mode 'floe', rollout 'floe', the one-step and fully-async trainers registered")
PYEOF

# Two cores shared: keep torch to few threads in every process verl starts. The whole suite
# runs under an outer timeout as well (each verl run has its own).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
run_suite timeout -k 60 2700 "$VENV/bin/python" -m pytest -q "${XDIST[@]}" -m verl tests/integrations/verl "$@"
