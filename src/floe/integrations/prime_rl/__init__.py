"""floe as prime-rl's trainer and inference server (`floe prime-trainer @ rl.toml`, `floe serve`).

prime-rl's orchestrator (verifiers environments, rollouts, advantages) runs unchanged: it writes
rollout micro-batches to `<run_dir>/rollouts/step_N/rank_R.bin` and polls
`<run_dir>/broadcasts/step_N/STABLE`; it talks to the inference server over HTTP (OpenAI chat and
completions, vLLM's `/inference/v1/generate`, `/pause`, `/update_weights`, `/resume`, `/health`),
which `floe serve` answers (floe.server.protocols.vllm_compat). This package is the trainer side:

  formats.py       prime-rl's wire structs (msgspec msgpack) and run-directory layout
  loss_mapping.py  prime-rl's `[trainer.loss]` -> a floe loss, or a refusal naming the key
  batch.py         packed micro-batches -> a floe Batch (with prime-rl's global token scale)
  config.py        the `@ rl.toml` layers -> what the trainer reads (and what it refuses)
  trainer.py       the loop: read step N, forward_backward + optim_step, sync, publish step N

The formats follow prime-rl at commit `PRIME_RL_COMMIT` (src/prime_rl/transports/rollouts/
types.py, transports/rollouts/filesystem.py, transports/weights/filesystem.py,
utils/pathing.py, inference/vllm/server.py, utils/client.py). Needs the `prime-rl` extra
(msgspec).
"""

PRIME_RL_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"  # PrimeIntellect-ai/prime-rl, 2026-08-21
