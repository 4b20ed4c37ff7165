"""`floe prime-rl` runs prime-rl's stock reverse-text recipe end to end (marker prime_rl,
scripts/ci/prime-rl.sh): prime-rl's real env server and orchestrator, floe serve, floe's trainer.

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
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from floe.models import make_tiny
from tests.integrations.prime_rl.test_prime_rl_schedule import prime_rl_root
from tests.server.conftest import free_port, free_port_pair

pytestmark = [pytest.mark.prime_rl, pytest.mark.timeout(900)]
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


def test_reverse_text_stock_recipe_runs_through_one_command_and_resumes(tmp_path: Path) -> None:
    out = launch(tmp_path, "examples/basic/reverse-text/rl.toml")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run_dir = tmp_path / "outputs" / "floe-run"
    reports = [json.loads(line) for line in (run_dir / "floe_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(1, STEPS + 1))
    versions = [r["weights_version"] for r in reports]
    assert versions == sorted(set(versions)) and len(versions) == STEPS  # a new version each step, in order
    for step in range(STEPS + 1):
        assert (run_dir / "broadcasts" / f"step_{step}" / "STABLE").is_file()
    # step 1 trains on rollouts of the startup weights: sampler and trainer log-probs agree
    first = reports[0]["metrics"]
    assert first["tokens"] > 0
    assert abs(first["kl_sampler_k3"]) < KL_TOLERANCE, first
    assert abs(first["ratio_mean"] - 1) < 1e-2 and first["ratio_min"] > 0.9 and first["ratio_max"] < 1.1, first
    # the orchestrator's own step lines, with the reward it logged, echoed by the launcher
    orch = [line for line in out.stdout.splitlines() if "orchestrator:" in line and "Reward" in line]
    assert len(orch) >= STEPS, out.stdout[-4000:]
    assert "prime-trainer: step 2" in out.stdout
    assert not list(run_dir.glob("rollouts/step_*/rank_*.bin"))  # they came over zmq
    # the recipe's [ckpt] (a checkpoint at the end): prime-rl's orchestrator and floe's trainer both wrote step 2
    final = run_dir / "checkpoints" / f"step_{STEPS}"
    assert (final / "orchestrator").is_dir() and (final / "trainer" / "floe.json").is_file(), list(final.iterdir())

    # prime-rl's `--resume` (the latest checkpoint), one more step: the orchestrator continues its
    # progress, the trainer its floe state, and the new step gets the next weights version
    again = launch(tmp_path, "examples/basic/reverse-text/rl.toml", "--max-steps", str(STEPS + 1), "--resume")
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert f"resuming from step {STEPS}" in again.stdout, again.stdout[-3000:]
    logs = sorted((run_dir / "logs").glob("attempt_*"))
    assert len(logs) == 2  # prime-rl's per-attempt log directories
    assert f"Resuming orchestrator from checkpoint step {STEPS}" in (logs[-1] / "orchestrator.log").read_text()
    assert f"resumed step {STEPS}" in (logs[-1] / "trainer.log").read_text()
    reports = [json.loads(line) for line in (run_dir / "floe_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(1, STEPS + 2))
    assert reports[-1]["weights_version"] == versions[-1] + 1
    assert abs(reports[-1]["metrics"]["kl_sampler_k3"]) < KL_TOLERANCE  # sampled by the restored policy
    assert (run_dir / "checkpoints" / f"step_{STEPS + 1}" / "trainer" / "floe.json").is_file()


def test_alphabet_sort_stock_recipe_trains_its_lora_adapter_over_several_turns(tmp_path: Path) -> None:
    # examples/basic/alphabet-sort: multi-turn (3 to 5 user turns per episode) with trainer.model.lora
    # (rank 32, alpha 64): floe serve trains that adapter, prime-rl's orchestrator syncs it through
    # /load_lora_adapter and samples by the adapter's name, as it does with vLLM. (A random model
    # earns reward 0 here, so these steps do not move the adapter; test_trainer.py and
    # test_vllm_compat.py show the adapter training and being served.) The run also splits "2 training
    # GPUs" (--deployment.num-train-gpus 2): prime-rl's orchestrator then writes two ranks' batches per
    # step and floe's trainer takes both ([floe] ranks follows it); the overlay's device places floe
    # serve on this CPU, and the GPU split is listed as not applying here.
    out = launch(tmp_path, "examples/basic/alphabet-sort/rl.toml", "--deployment.num-train-gpus", "2",
                 "--floe.backend.device", "cpu", seq_len=2048)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run_dir = tmp_path / "outputs" / "floe-run"
    reports = [json.loads(line) for line in (run_dir / "floe_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(1, STEPS + 1))
    versions = [r["weights_version"] for r in reports]
    assert versions == sorted(set(versions)) and len(versions) == STEPS
    first = reports[0]["metrics"]
    assert abs(first["kl_sampler_k3"]) < KL_TOLERANCE, first  # sampled by the policy the trainer holds
    logs = next((run_dir / "logs").glob("attempt_*"))
    assert "the server trains a LoRA adapter (rank 32, alpha 64.0)" in (logs / "trainer.log").read_text()
    # prime-rl's auto_setup_lora gave the orchestrator the adapter's name: with it set, prime-rl's
    # update_weights posts /load_lora_adapter (raise_for_status: a refusal stops the run) and every
    # request names the adapter (a 404 otherwise), so exit 0 means floe serve answered both
    orch_config = json.loads((run_dir / "configs" / "orchestrator.json").read_text())
    assert orch_config["model"]["lora"]["name"] == "r32-a64.0", orch_config["model"]
    assert orch_config["num_train_workers"] == 2
    assert "accepted without effect here: deployment.num_train_gpus ([floe.backend] places floe serve" in out.stdout
    assert "gradient_checkpointing=True" in out.stdout  # trainer.model.ac (the recipe's freq = 1)
    orch = [line for line in out.stdout.splitlines() if "orchestrator:" in line and "Reward" in line]
    assert len(orch) >= STEPS, out.stdout[-4000:]
    # every episode ran the recipe's 3 to 5 turns (prime-rl's orchestrator metrics, per step)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    turns = [(m["train/alphabet-sort/all/num_turns/min"], m["train/alphabet-sort/all/num_turns/max"])
             for m in metrics if "train/alphabet-sort/all/num_turns/min" in m]
    assert len(turns) == STEPS and all(3 <= lo <= hi <= 5 for lo, hi in turns), turns


def test_a_dying_child_stops_the_run_and_is_named(tmp_path: Path) -> None:
    # prime-rl's orchestrator is killed once it has started: the launcher stops everything else
    args, env = command(tmp_path, "examples/basic/reverse-text/rl.toml")
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[str, int] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.search(r"started (.+?) \(pid (\d+)\)", line)
        if found:
            pids["env server" if "env server" in found.group(1) else found.group(1)] = int(found.group(2))
        if "orchestrator" in pids:
            break
    assert set(pids) == {"env server", "orchestrator"}, pids
    os.kill(pids["orchestrator"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert "orchestrator exited with status -9" in err and "orchestrator.log" in err, err[-3000:]
    assert not alive(pids["env server"])  # stopped with the run: no orphan


def test_a_gpu_split_on_this_cpu_machine_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # wordle's [deployment] asks for 2 + 6 GPUs; the machine (CUDA_VISIBLE_DEVICES="") has none
    out = launch(tmp_path, "examples/basic/wordle/rl.toml", timeout_s=300)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "deployment.num_train_gpus" in out.stderr and "2 training + 6 inference GPUs" in out.stderr, out.stderr[-3000:]
    assert "started" not in out.stdout  # nothing was launched
