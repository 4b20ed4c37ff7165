"""Learning evidence for `floe prime-rl` (issue 20 part 6): prime-rl's stock reverse-text recipe
on CPU, from a tiny warm-started model, through the one command; the orchestrator's reward per step.

prime-rl's recipe (examples/basic/reverse-text/rl.toml) starts from a reverse-text SFT of
Qwen3-0.6B; here the start is floe's own tiny Qwen3 of recipes/reverse_text.toml, warm-started
by floe's SFT on demonstrations in prime-rl's format (the taskset's system prompt, the answer in
<reversed_text> tags; floe.rl.warmstart.prepare_model, cached under ~/.cache/floe) for
--warm-start-steps steps (default 1100: with the taskset's 83-token system prompt the tiny model
first learns only the format and the length; it starts copying the letters between steps 800 and
1000, and 1100 steps give a sampled reward of about 0.65, room to rise; 220, floe's own recipe's
count, gave random letters, reward about 0.15). The data is
256 strings of 1 to 6 characters as floe's reverse_text family draws them, written as the local
copy of the taskset's dataset (PrimeIntellect/Reverse-Text-RL, column `prompt`).

Overrides of the recipe (model, data, sizes; every algorithm key stays prime-rl's: the DPPO loss
with its 0.2 masks, AdamW, the constant schedule, the group-relative advantage):
  model.name                      the warm-started tiny model; orchestrator.renderer.name default
                                  (the recipe's prime-qwen3 needs Qwen3's special tokens)
  orchestrator.batch_size 32, group_size 8 (the recipe: 128, 16); max_completion_tokens 48 (the
                                  tags alone are 31 characters of this character-level tokenizer);
  seq_len 512; max_steps 20 (the recipe's 20)
  trainer.optim.lr 3e-4: the recipe's 3e-6 is tuned for 0.6B parameters; a 0.42M-parameter model
                                  needs the rate floe's own tiny recipe trains with (its
                                  [backend.optimizer] lr); the run with 3e-6 is `--lr 3e-6`

Run in prime-rl's environment (scripts/ci/prime-rl.sh builds it; the CPU stand-ins on PYTHONPATH):
  P=~/.cache/floe-ci/prime-rl-<hash>
  PYTHONPATH=$PWD/src HF_HUB_OFFLINE=1 FLOE_PRIME_RL_CPU_STUBS=$P/cpu-stubs \\
      $P/bin/python benchmarks/bench_prime_rl_reverse_text.py
Writes benchmarks/results/prime_rl_reverse_text.json (--out) and docs/img/prime_rl_reverse_text.png,
which plots every benchmarks/results/prime_rl_reverse_text*.json (--plot-only redraws it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."  # the taskset's
REWARD = "train/reverse-text/all/agent/reward/mean"


def warm_started_model(steps: int) -> str:
    """floe's tiny reverse_text model, warm-started for `steps` SFT steps on prime-rl's prompt
    format (cached)."""
    from floe.config import load_layers
    from floe.rl.config import parse_recipe
    from floe.rl.progress import RunProgress
    from floe.rl.warmstart import prepare_model

    data = load_layers([ROOT / "recipes/reverse_text.toml"], {
        "env.options.system_prompt": True, "env.options.instruction": SYSTEM, "warm_start.steps": steps})
    return prepare_model(parse_recipe(data), RunProgress().warm_start)


def write_data(cwd: Path, count: int = 256) -> None:
    from floe.envs import make_family

    family = make_family("reverse_text", min_length=1, max_length=6)
    texts = [t.data["text"] for t in family.tasks("train", count, seed=0)]
    out = cwd / "PrimeIntellect" / "Reverse-Text-RL"
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", default="3e-4")
    parser.add_argument("--warm-start-steps", type=int, default=1100)
    parser.add_argument("--work", type=Path, default=Path("/tmp/floe-prime-rl-reverse-text"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/prime_rl_reverse_text.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/img/prime_rl_reverse_text.png")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the plot of the saved results")
    args = parser.parse_args()
    if args.plot_only:
        plot(sorted(args.out.parent.glob("prime_rl_reverse_text*.json")), args.plot)
        return

    from tests.integrations.prime_rl.test_launch import lock_date, stubs  # the suite's environment rules
    from tests.integrations.prime_rl.test_prime_rl_schedule import prime_rl_root

    print("warm start (floe SFT, cached after the first run) ...", flush=True)
    model = warm_started_model(args.warm_start_steps)
    args.work.mkdir(parents=True, exist_ok=True)
    write_data(args.work)
    out_dir = args.work / f"outputs-lr{args.lr}-b{args.batch_size}-sft{args.warm_start_steps}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), stubs()]), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": "",
           "UV_EXCLUDE_NEWER": lock_date(prime_rl_root()), "UV_CACHE_DIR": str(Path(sys.prefix) / "uv-cache")}
    cmd = [sys.executable, "-m", "floe.cli", "prime-rl", "@", str(prime_rl_root() / "examples/basic/reverse-text/rl.toml"),
           "@", str(ROOT / "recipes/prime_rl/floe.toml"),
           "--model.name", model, "--orchestrator.renderer.name", "default",
           "--orchestrator.batch-size", str(args.batch_size), "--orchestrator.group-size", str(args.group_size),
           "--seq-len", "512", "--orchestrator.train.sampling.max-completion-tokens", "48",
           "--max-steps", str(args.steps), "--trainer.optim.lr", args.lr,
           "--orchestrator.model.client.base-url", f"http://127.0.0.1:{free_port()}/v1",
           "--orchestrator.env-server-base-port", str(free_port()),
           "--rollout-transport.port", str(free_port()), "--output-dir", str(out_dir),
           "--clean"]  # a rerun starts afresh (prime-rl refuses a run directory holding a run)
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=args.work, env=env, text=True, check=False)  # its step lines stream here
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"floe prime-rl exited {proc.returncode}")
    metrics = [json.loads(line) for line in (out_dir / "floe-run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [(m["step"], m[REWARD]) for m in metrics if REWARD in m]
    trainer = [json.loads(line) for line in (out_dir / "floe-run" / "floe_trainer.jsonl").read_text().splitlines()]
    result = {"command": " ".join(cmd), "model": model, "warm_start_steps": args.warm_start_steps,
              "lr": float(args.lr), "seconds": round(seconds, 1),
              "batch_size": args.batch_size, "group_size": args.group_size, "reward_by_step": rewards,
              "first5_mean": sum(r for _, r in rewards[:5]) / min(5, len(rewards)),
              "last5_mean": sum(r for _, r in rewards[-5:]) / min(5, len(rewards)),
              "trainer_kl_sampler_k3": [t["metrics"].get("kl_sampler_k3") for t in trainer]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"reward, first 5 steps {result['first5_mean']:.3f} -> last 5 {result['last5_mean']:.3f} "
          f"({len(rewards)} steps, {seconds:.0f} s); {args.out}")

    plot(sorted(args.out.parent.glob("prime_rl_reverse_text*.json")), args.plot)


def plot(results: list[Path], path: Path) -> None:
    """Every result file's reward per step on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for file in results:
        r = json.loads(file.read_text())
        steps = r["reward_by_step"]
        ax.plot([s for s, _ in steps], [v for _, v in steps], marker="o", markersize=3,
                label=f"lr {r['lr']:g}, {r['batch_size']} samples/step, SFT {r.get('warm_start_steps', 220)}")
    ax.set_xlabel("step (prime-rl's orchestrator)")
    ax.set_ylabel("mean reward (LCS ratio)")
    ax.set_title("prime-rl reverse-text recipe on floe, tiny model, CPU")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
