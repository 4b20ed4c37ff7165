"""The one command of the launch tests (test_launch*.py, marker prime_rl, scripts/ci/prime-rl.sh):
`floe prime-rl` on a prime-rl stock recipe, end to end: prime-rl's real env server and
orchestrator, floe serve, floe's trainer. Two files, so that pytest-xdist runs the two long
launches (reverse-text with its resume; alphabet-sort) side by side.

The recipe file is prime-rl's, unchanged; the command overrides only:
  model          --model.name <make_tiny dir> (random init, char tokenizer with a chat template) and
                 --orchestrator.renderer.name default (the recipe picks prime-qwen3 for its Qwen3
                 model: that renderer needs Qwen3's special tokens)
  sizes / steps  batch_size 4, group_size 2, seq_len 256, max_completion_tokens 8, max_steps 2
  placement      orchestrator.model.client.base_url (a free port: floe serve binds it),
                 orchestrator.env_server_base_port (a free port, not prime-rl's fixed 5000), output_dir,
                 rollout_transport.port (free ports for prime-rl's default zmq transport; type = "zmq")
  algorithm      orchestrator.train.filter_zero_advantages false: a random-init model never writes
                 the <reversed_text> tags, every reward is 0, and prime-rl would drop every sample
                 (10 empty batches, then it stops)
Data: the taskset loads the hub dataset PrimeIntellect/Reverse-Text-RL; offline, datasets' load_dataset
reads a local directory of that name first, so the test writes 16 rows of the same schema
({"prompt": text}) to <cwd>/PrimeIntellect/Reverse-Text-RL/train.jsonl and runs from that cwd.
CPU only: prime-rl's orchestrator imports GPU-only packages at module load; CI puts the import
stand-ins of scripts/prime_rl/cpu_stubs.sh on its PYTHONPATH ($FLOE_PRIME_RL_CPU_STUBS).
The taskset's harness (verifiers' `null` harness) is a PEP 723 script whose unpinned dependencies
`uv sync --script` resolves at run time: UV_EXCLUDE_NEWER, the newest upload in prime-rl's uv.lock,
resolves them as of prime-rl's pin (a later openai broke that harness's httpx timeout), in a uv
cache of the test's own Python environment (an environment resolved earlier elsewhere is not reused).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from floe.models import make_tiny
from tests.integrations.prime_rl.test_prime_rl_schedule import prime_rl_root
from tests.server.conftest import free_port, free_port_pair

ROOT = Path(__file__).resolve().parents[3]
STEPS = 2
KL_TOLERANCE = 1e-3  # mean k3 KL(sampler || policy) per token at step 1: same weights, float32 on CPU


def stubs() -> str:
    path = os.environ.get("FLOE_PRIME_RL_CPU_STUBS", "")
    if not path or not Path(path, "sitecustomize.py").is_file():
        pytest.fail("FLOE_PRIME_RL_CPU_STUBS missing: the CPU import stand-ins (scripts/prime_rl/cpu_stubs.sh; set by scripts/ci/prime-rl.sh)")
    return path


def lock_date(root: Path) -> str:
    """The newest `upload-time` in prime-rl's uv.lock: the moment its pin was resolved."""
    return max(re.findall(r'upload-time = "([^"]+)"', (root / "uv.lock").read_text()))


def command(tmp: Path, recipe: str, *extra: str, seq_len: int = 256) -> tuple[list[str], dict[str, str]]:
    """`floe prime-rl @ <prime-rl's recipe> @ floe.toml` with the overrides of the module doc (then
    `extra`), and its env. The model and both tasksets' data are made once per `tmp`."""
    model = tmp / "tiny"
    if not model.exists():
        make_tiny(model, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=2048)
    rng = random.Random(0)
    write_rows(tmp / "PrimeIntellect" / "Reverse-Text-RL",
               [{"prompt": "".join(rng.choice("abcdefgh ") for _ in range(8))} for _ in range(16)])
    # alphabet-sort's source (kalomaze/alphabetic-arxiv-authors-it1): lists of "First Last" names, long
    # enough for the recipe's 3 to 5 turns of 1 to 5 names each
    write_rows(tmp / "kalomaze" / "alphabetic-arxiv-authors-it1",
               [{"names": [f"{rng.choice('ABCDEFGH')}{rng.choice('aeiou')} {rng.choice('KLMNPRST')}{rng.choice('aeiou')}"
                           for _ in range(30)]} for _ in range(8)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), stubs()]), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": "",
           "UV_EXCLUDE_NEWER": lock_date(prime_rl_root()), "UV_CACHE_DIR": str(Path(sys.prefix) / "uv-cache")}
    args = [sys.executable, "-m", "floe.cli", "prime-rl", "@", str(prime_rl_root() / recipe),
            "@", str(ROOT / "recipes/prime_rl/floe.toml"),
            "--model.name", str(model), "--orchestrator.renderer.name", "default",
            "--orchestrator.batch-size", "4", "--orchestrator.group-size", "2", "--seq-len", str(seq_len),
            "--orchestrator.train.sampling.max-completion-tokens", "8", "--max-steps", str(STEPS),
            "--orchestrator.train.filter-zero-advantages", "false",
            "--orchestrator.model.client.base-url", f"http://127.0.0.1:{free_port()}/v1",
            "--orchestrator.env-server-base-port", str(free_port()),
            "--rollout-transport.type", "zmq", "--rollout-transport.port", str(free_port_pair()),
            "--output-dir", str(tmp / "outputs"), *extra]
    return args, env


def write_rows(directory: Path, rows: list[dict]) -> None:
    """A local dataset directory of that hub id (datasets' load_dataset reads it offline)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def launch(tmp: Path, recipe: str, *extra: str, timeout_s: float = 800, seq_len: int = 256) -> subprocess.CompletedProcess[str]:
    args, env = command(tmp, recipe, *extra, seq_len=seq_len)
    return subprocess.run(args, check=False, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
