#!/usr/bin/env bash
# Build a Python 3.12 environment in which prime-rl's real orchestrator (pinned commit
# floe.integrations.prime_rl.PRIME_RL_COMMIT) imports and starts on a CPU machine. Outside the
# repository: everything goes under $PRL_ROOT (default /tmp/prime-rl-orch).
#
# Usage: PRIME_RL_SRC=<prime-rl checkout at the pinned commit> \
#        TORCHTITAN_SRC=<torchtitan checkout at 23e4dfc (prime-rl's uv source pin)> \
#        VERIFIERS_SRC=<PrimeIntellect-ai/verifiers at a60a606 (prime-rl's deps/verifiers submodule)> \
#        bash scripts/prime_rl/orchestrator_env.sh
# Then:  PYTHONPATH=$PRL_ROOT/stubs $PRL_ROOT/venv/bin/orchestrator --help
#
# What it shows (verified at the pinned commit, 2026-12): the orchestrator's own runtime needs
# are CPU packages, but two GPU-only packages are imported unconditionally at module load,
#   prime_rl/orchestrator/orchestrator.py:77 -> orchestrator/watcher.py:14
#     -> transports/weights/__init__.py:8  -> transports/weights/filesystem.py:10
#     -> trainer/lora.py:8 -> trainer/models/__init__.py:16 (glm_moe_dsa)
#     -> glm_moe_dsa/sparse_mla_attention.py:10 -> utils/cp.py:12 `from ring_flash_attn import ...`
#     -> ring_flash_attn/__init__.py -> `from flash_attn.flash_attn_interface import ...`  (flash-attn: CUDA wheel)
#   transports/weights/__init__.py:9 -> transports/weights/nccl.py:11
#     `from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator`        (vllm: GPU build)
# so $PRL_ROOT/stubs holds import-only stand-ins for those names (scripts/prime_rl/cpu_stubs.sh);
# the filesystem weight broadcast and rollout transport the floe overlay selects call none of them.
# The one command, `floe prime-rl` (docs/integrations.md), is the way to run a recipe; this
# environment and run_orchestrator.sh are the by-hand pieces.
set -euo pipefail
: "${PRIME_RL_SRC:?a prime-rl source snapshot at the pinned commit}"
: "${TORCHTITAN_SRC:?a torchtitan source snapshot at 23e4dfc}"
: "${VERIFIERS_SRC:?a PrimeIntellect-ai/verifiers snapshot at a60a606ecc4d309247edf9ff92c3eabca362781f}"
PRL_ROOT=${PRL_ROOT:-/tmp/prime-rl-orch}
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python}
mkdir -p "$PRL_ROOT"
[ -x "$PRL_ROOT/venv/bin/python" ] || "$PY312" -m venv "$PRL_ROOT/venv"
PIP="$PRL_ROOT/venv/bin/pip"
"$PIP" install --quiet --upgrade pip
# torch 2.13.0 for cp312 (PyPI's build; it runs on CPU, with its nvidia-* runtime wheels).
"$PIP" install --quiet torch==2.13.0
"$PIP" install --quiet --no-deps -e "$PRIME_RL_SRC" -e "$PRIME_RL_SRC/packages/prime-rl-configs"
"$PIP" install --quiet --no-deps "$TORCHTITAN_SRC"
# What the orchestrator's modules import, found by importing and reading the errors; versions
# from prime-rl's uv.lock where the newest release breaks an import (wandb_gql left wandb 0.28,
# torchao.prototype.mx_formats.mx_linear left torchao 0.18).
"$PIP" install --quiet "verifiers==0.4.0" msgspec "prime>=0.6.19" "modelexpress" orjson pyarrow \
  "wandb==0.27.0" "wandb-workspaces>=0.4.3" "transformers==5.6.2" aiolimiter prometheus_client \
  ring_flash_attn flash-linear-attention pynvml jaxtyping "torchao==0.17.0" psutil setproctitle tyro \
  datasets torchdata tensorboard
# The orchestrator at the pinned commit needs the verifiers it pins (its deps/verifiers submodule,
# a60a606ecc4d309247edf9ff92c3eabca362781f, after 0.4.0): with the 0.4.0 release its train sink
# fails on `Branch.multi_modal_data` (orchestrator/trajectories.py:134). verifiers 0.4.0 above
# brings the dependencies; the pinned source replaces it, plus what it adds (mcp < 2, uvloop).
# hatch-vcs cannot read a version from a source snapshot: give it one.
SETUPTOOLS_SCM_PRETEND_VERSION=0.4.1.dev0 "$PIP" install --quiet --no-deps "$VERIFIERS_SRC"
"$PIP" install --quiet "mcp>=1.24.0,<2" uvloop

STUBS="$PRL_ROOT/stubs"
bash "$(dirname "$0")/cpu_stubs.sh" "$STUBS"   # the import stand-ins (one writer: cpu_stubs.sh)

cd "$PRL_ROOT"  # not the repository: its tests/ would shadow modules
PYTHONPATH="$STUBS" "$PRL_ROOT/venv/bin/python" -c "import prime_rl.orchestrator.orchestrator, prime_rl.entrypoints.orchestrator, prime_rl.entrypoints.env_server"
echo "orchestrator_env.sh: prime-rl's orchestrator imports in $PRL_ROOT/venv (PYTHONPATH=$STUBS)"
