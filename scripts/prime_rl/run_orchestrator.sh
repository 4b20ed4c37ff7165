#!/usr/bin/env bash
# prime-rl's real orchestrator (and its env server) against floe, end to end, on CPU.
#
#   bash scripts/prime_rl/run_orchestrator.sh
#
# Four processes, each with its own log under $WORK/logs:
#   floe serve          (.venv, Python 3.11)  a random-init tiny Qwen3 with a chat template
#                                            (floe.models.make_tiny): trains and samples
#   env-server          (prime-rl's, 3.12)   serves tests/integrations/prime_rl/floe_count_env.py
#                                            (a multi-turn verifiers 0.4.0 environment)
#   orchestrator        (prime-rl's, 3.12)   unchanged; config scripts/prime_rl/orch.toml
#   floe prime-trainer  (.venv)              @ scripts/prime_rl/rl.toml @ recipes/prime_rl/floe.toml
# The orchestrator sends each step's rollouts over zmq (prime-rl's default), the trainer trains on them through floe
# serve and publishes broadcasts/step_N/STABLE, the orchestrator's watcher sees it, calls
# floe serve's /update_weights and goes on. Success = both prime-rl processes exit 0 after
# MAX_STEPS steps; the script then prints the step lines of every log.
#
# Needs the Python 3.12 environment of scripts/prime_rl/orchestrator_env.sh ($PRL_ROOT, default
# /tmp/prime-rl-orch: venv/ and stubs/) and the repository's .venv with floe[prime-rl].
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$REPO/scripts/prime_rl"
PRL_ROOT=${PRL_ROOT:-/tmp/prime-rl-orch}
WORK=${WORK:-/tmp/floe-prime-rl-run}
MAX_STEPS=${MAX_STEPS:-3}
TIMEOUT_S=${TIMEOUT_S:-1500}
FLOE_PY="$REPO/.venv/bin/python"
PRL_BIN="$PRL_ROOT/venv/bin"
[ -x "$PRL_BIN/orchestrator" ] || { echo "no $PRL_BIN/orchestrator: run scripts/prime_rl/orchestrator_env.sh" >&2; exit 2; }

free_port() { "$FLOE_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SERVE_PORT=${SERVE_PORT:-$(free_port)}
ENV_PORT=${ENV_PORT:-$(free_port)}
export FLOE_TOKEN=${FLOE_TOKEN:-prime-run-token}

rm -rf "$WORK"
mkdir -p "$WORK/logs"
RUN_DIR="$WORK/outputs/floe-run"   # <output_dir>/<run.name>: the orchestrator's output_dir

# 1. The model and floe serve.
"$FLOE_PY" -c "from floe.models import make_tiny; make_tiny('$WORK/tiny', hidden_size=32, intermediate_size=64, num_hidden_layers=2)"
cat > "$WORK/serve.toml" <<EOF
[backend]
model = "$WORK/tiny"
state_dir = "$WORK/states"
seed = 0

[backend.optimizer]   # prime-rl's default AdamW (floe prime-trainer refuses a server that differs)
betas = [0.9, 0.999]
eps = 1e-08
weight_decay = 0.01
grad_clip = 1.0

[server]
served_model_name = "$WORK/tiny"   # prime-rl serves and checks the model under its \`model.name\`
EOF

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 1
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

"$REPO/.venv/bin/floe" serve "$WORK/serve.toml" --port "$SERVE_PORT" > "$WORK/logs/floe_serve.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$SERVE_PORT/ready" > /dev/null && break
  sleep 0.5
done
curl -sf "http://127.0.0.1:$SERVE_PORT/ready" > /dev/null || { tail -50 "$WORK/logs/floe_serve.log"; exit 1; }
echo "floe serve ready on :$SERVE_PORT"

# 2. prime-rl's configs, with this run's paths and ports.
subst() { sed -e "s#@WORK@#$WORK#g" -e "s#@SERVE_PORT@#$SERVE_PORT#g" -e "s#@ENV_PORT@#$ENV_PORT#g" \
              -e "s#@MAX_STEPS@#$MAX_STEPS#g" "$1" > "$2"; }
subst "$HERE/orch.toml" "$WORK/orch.toml"
subst "$HERE/env_server.toml" "$WORK/env_server.toml"
subst "$HERE/rl.toml" "$WORK/rl.toml"

# prime-rl's processes: its 3.12 venv, the import stand-ins, and floe_count_env on the path.
# Run from $WORK (prime-rl's own checkout has a tests/ package that would shadow modules).
PRL_PATH="$PRL_ROOT/stubs:$REPO/tests/integrations/prime_rl"
cd "$WORK"

# 3. prime-rl's env server (what prime-rl's `rl` launcher would spawn for the train source).
PYTHONPATH="$PRL_PATH" "$PRL_BIN/env-server" @ "$WORK/env_server.toml" > "$WORK/logs/env_server.log" 2>&1 &
PIDS+=($!)

# 4. floe's trainer (publishes step 0, then waits for rollouts).
"$REPO/.venv/bin/floe" prime-trainer @ "$WORK/rl.toml" @ "$REPO/recipes/prime_rl/floe.toml" \
  --floe.url "http://127.0.0.1:$SERVE_PORT" --floe.wait-timeout-s "$TIMEOUT_S" \
  > "$WORK/logs/trainer.log" 2>&1 &
TRAINER=$!
PIDS+=($TRAINER)

# 5. prime-rl's orchestrator, unchanged.
set +e
PYTHONPATH="$PRL_PATH" timeout "$TIMEOUT_S" "$PRL_BIN/orchestrator" @ "$WORK/orch.toml" > "$WORK/logs/orchestrator.log" 2>&1
ORCH_RC=$?
# The trainer ends by itself after MAX_STEPS; if the orchestrator failed it would wait on.
[ "$ORCH_RC" = 0 ] || kill "$TRAINER" 2>/dev/null
wait "$TRAINER"
TRAINER_RC=$?
set -e

echo "== orchestrator exit $ORCH_RC, trainer exit $TRAINER_RC"
echo "== trainer"; grep "prime-trainer:" "$WORK/logs/trainer.log" || tail -30 "$WORK/logs/trainer.log"
echo "== orchestrator"
sed 's/\x1b\[[0-9;]*m//g' "$WORK/logs/orchestrator.log" | grep -E "SUCCESS|ERROR|Error|policy in-flight" | tail -40 || true
echo "== broadcasts"; ls "$RUN_DIR/broadcasts"/*/STABLE 2>/dev/null || true
echo "== rollouts"; ls "$RUN_DIR/rollouts"/*/ 2>/dev/null || true
echo "== floe serve requests (count, method, path, status)"
grep -oE '"method": "[A-Z]+", "path": "[^"]+", "status": [0-9]+' "$WORK/logs/floe_serve.log" | sort | uniq -c || true
[ "$ORCH_RC" = 0 ] && [ "$TRAINER_RC" = 0 ]
