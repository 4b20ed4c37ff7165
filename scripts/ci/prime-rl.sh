#!/usr/bin/env bash
# The prime-rl suite (pytest marker `prime_rl`): prime-rl's own code (config classes, LR
# scheduler) next to `floe prime-trainer`, in its own cached Python 3.12
# environment (scripts/ci/lib.sh).
#
# prime-rl is not on the package index. ../shared/vendor holds `git archive` exports of the
# commits floe pins (its README says which): prime-rl 559b447, the verifiers commit it needs
# (a60a606) and torchtitan 23e4dfc. They are unpacked into the environment's directory (never
# into the checkout) and installed editable from there without dependency resolution; then their
# requirements from the index at the versions of prime-rl's own uv.lock (a pip constraints file
# made from it), less the CUDA-only wheels prime-rl's trainer and vLLM inference need (vllm,
# flash-attn kernels, mooncake, nixl, ...) and less `dion` (a git-only optimizer package:
# floe.integrations.prime_rl.schedule imports prime-rl's scheduler without it). modelexpress
# (imported by the orchestrator) goes in without its CUDA-only nixl requirement.
# The archives' hashes are part of the environment's hash, so a new snapshot rebuilds it.
# The suite finds the unpacked prime-rl through the installed `prime_rl` package. It runs prime-rl's
# real env server and orchestrator through `floe prime-rl` (tests/integrations/prime_rl/test_launch*.py):
# on this CPU machine they need import-only stand-ins for the GPU-only packages they import at module
# load (scripts/prime_rl/cpu_stubs.sh, written into the environment's directory, never the checkout,
# and put on those processes' PYTHONPATH only by the test; floe never installs them for users).
# Usage: bash scripts/ci/prime-rl.sh [extra pytest args]
# Python 3.12: `python3.12` where it runs, else the pyenv root's 3.12 (pyenv's shim refuses
# python3.12 while 3.12 is not a selected version).
if [ -z "${PYTHON:-}" ]; then
  for PYTHON in python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
    "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && break
  done
fi
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
  || { echo "prime-rl.sh: no Python 3.12 found (prime-rl requires ~=3.12.0); set PYTHON"; exit 1; }
export PYTHON
source "$(dirname "$0")/lib.sh"

VENDOR=../shared/vendor
ARCHIVES="prime-rl-559b447 verifiers-a60a606 torchtitan-23e4dfc"
HASHES=""
for a in $ARCHIVES; do
  [ -f "$VENDOR/$a.tar.gz" ] || { echo "prime-rl.sh: $VENDOR/$a.tar.gz missing (see $VENDOR/README.md)"; exit 1; }
  HASHES="$HASHES $a:$(sha256sum "$VENDOR/$a.tar.gz" | cut -c1-16)"
done
# The verifiers archive has no git tags for hatch-vcs: its version is the one prime-rl requires
# (>=0.3.1.dev59) with the commit as a local label.
VF_VERSION="0.4.0+a60a606"
# Not installed: CUDA-only or git-only requirements of prime-rl (see above), and what the
# archives themselves provide.
EXCLUDED="torch torchvision torchaudio vllm mooncake-transfer-engine ring-flash-attn tilelang
  flash-linear-attention dion modelexpress torchao nvidia-ml-py prime-rl-configs verifiers torchtitan prime-rl
  nixl deep-ep deep-gemm flash-attn flash-attn-3 flash-attn-4 vllm-router prime-kernels"
EXTRA_PINS="pytest-asyncio"
MODELEXPRESS=0.3.0  # prime-rl's pin
if stack_env prime-rl "$TORCH_PIN $HASHES verifiers:$VF_VERSION modelexpress:$MODELEXPRESS excluded:$EXCLUDED lock $EXTRA_PINS"; then
  SRC="$VENV/src"
  mkdir -p "$SRC"
  for a in $ARCHIVES; do
    mkdir -p "$SRC/$a"
    tar -xzf "$VENDOR/$a.tar.gz" -C "$SRC/$a"
  done
  PRL="$SRC/prime-rl-559b447/prime-rl"
  SETUPTOOLS_SCM_PRETEND_VERSION=$VF_VERSION "$VENV/bin/pip" install --quiet --no-deps -e "$SRC/verifiers-a60a606/verifiers"
  "$VENV/bin/pip" install --quiet --no-deps -e "$SRC/torchtitan-23e4dfc/torchtitan" \
    -e "$PRL/packages/prime-rl-configs" -e "$PRL" "modelexpress==$MODELEXPRESS"
  # prime-rl's locked versions of the index packages (torch and the excluded ones left out).
  "$VENV/bin/python" - "$PRL/uv.lock" "$EXCLUDED" > "$VENV/prime-rl-constraints.txt" <<'PYEOF'
import re, sys, tomllib
skip = set(sys.argv[2].split())
for p in tomllib.load(open(sys.argv[1], "rb"))["package"]:
    if "registry" in p.get("source", {}) and p["name"] not in skip and not re.match(r"nvidia-|triton$|cuda-", p["name"]):
        print(f"{p['name']}=={p['version']}")
PYEOF
  {
    requirements_of verifiers "$EXCLUDED"
    requirements_of torchtitan "$EXCLUDED"
    requirements_of prime-rl-configs "$EXCLUDED"
    requirements_of prime-rl "$EXCLUDED"
    # modelexpress 0.3.0 declares protobuf<6; prime-rl's lock overrides that (<7, its protobuf 6 pin)
    requirements_of modelexpress "$EXCLUDED nixl protobuf"
  } | sort -u > "$VENV/prime-rl-requirements.txt"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install --quiet -c "$VENV/prime-rl-constraints.txt" -r "$VENV/prime-rl-requirements.txt" \
    $EXTRA_PINS "$TORCH_PIN"
  "$VENV/bin/python" -c "import sys; from importlib.metadata import version
version('verifiers') == '$VF_VERSION' or sys.exit(f\"prime-rl.sh: verifiers {version('verifiers')}, expected $VF_VERSION\")"
  stack_built
fi
install_floe test,prime-rl
# The tasksets the stock recipes name (verifiers' environments/, from the archive; they need only datasets).
"$VENV/bin/pip" install --quiet --no-deps -e "$VENV/src/verifiers-a60a606/verifiers/environments/reverse_text" \
  -e "$VENV/src/verifiers-a60a606/verifiers/environments/alphabet_sort"
# prime-rl's config classes and its scheduler (through floe's import of it) load. (Its orchestrator
# imports CUDA-only packages at module load: ring_flash_attn, flash_attn; not in this environment.)
"$VENV/bin/python" -c "import prime_rl.configs.rl
from floe.integrations.prime_rl.schedule import prime_rl_scheduler_module
assert prime_rl_scheduler_module() is not None"

# CPU import stand-ins for prime-rl's orchestrator (see the header).
bash "$(dirname "$0")/../prime_rl/cpu_stubs.sh" "$VENV/cpu-stubs"
export FLOE_PRIME_RL_CPU_STUBS="$VENV/cpu-stubs"

# Two cores shared: few threads; nothing reaches a hub; no W&B, no GPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled CUDA_VISIBLE_DEVICES=
run_suite timeout -k 60 1800 "$VENV/bin/python" -m pytest -q "${XDIST[@]}" -m prime_rl tests/integrations/prime_rl "$@"
