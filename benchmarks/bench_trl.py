"""floe's training step against TRL's GRPOTrainer on the same model, batch and loss.

Both sides get the same tiny Qwen3 (fresh copies of the same weights), the same GRPO batch
(`--groups` prompts of P tokens, n variable-length completions each, fixed advantages and
old log-probs) and the same loss: DAPO, i.e. the clipped PPO objective with clip ε_low = 0.2,
ε_high = 0.28, aggregated as token_mean over the whole batch, no KL (β = 0), entropy computed
but not in the loss, no gradient checkpointing, fp32, AdamW.

What is timed (training part only; TRL's generation and reward scoring are excluded):

* TRL: `trainer.compute_loss(model, inputs)` on a prepared inputs dict (prompt_ids /
  prompt_mask left-padded, completion_ids / completion_mask right-padded, advantages,
  old_per_token_logps, num_items_in_batch) — this is what `GRPOTrainer.training_step` runs
  after `_prepare_inputs` — then `loss.backward()` and `optimizer.step()`/`zero_grad()`.
  TRL's default per-device micro-batch is the whole batch here (one micro-batch).
* floe: `PolicyZone.forward_backward(batch, ppo token_mean)` + `optim_step()`, default
  `prefix_dedup="auto"` (one micro-batch).

The two losses are checked to agree before timing.

    pip install -e '.[bench]'        # trl --no-deps + accelerate, datasets (see docs/benchmarks.md)
    .venv/bin/python benchmarks/bench_trl.py [--quick]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from typing import Any

import torch
from common import grpo_batch, model_arguments, progress_bar, summary, time_interleaved, tiny_model_dir, two_bar_chart, write_json

from floe.backend.policy import PolicyZone
from floe.compute.losses import resolve_loss
from floe.config import ComputeConfig, OptimizerConfig
from floe.models.loading import load_model, load_tokenizer
from floe.types import Batch

CLIP_LOW, CLIP_HIGH, LR = 0.2, 0.28, 1e-6


def trl_trainer(model_dir: str, batch_size: int, n: int, max_completion: int):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)
    model = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=batch_size,
        num_generations=n,
        max_completion_length=max_completion,
        loss_type="dapo",
        beta=0.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        learning_rate=LR,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
    )
    data = Dataset.from_dict({"prompt": ["x"] * batch_size})
    trainer = GRPOTrainer(
        model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args, train_dataset=data, processing_class=tok,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which we bypass
    return trainer


def trl_inputs(batch: Batch, pad_id: int) -> dict[str, Any]:
    """The dict GRPOTrainer._compute_loss reads, built from a floe batch."""
    rows = [(g.prompt, s) for g in batch.groups for s in g.samples]
    p_max = max(len(p) for p, _ in rows)
    r_max = max(len(s.tokens) for _, s in rows)
    b = len(rows)
    prompt_ids = torch.full((b, p_max), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p_max), dtype=torch.long)
    completion_ids = torch.full((b, r_max), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((b, r_max), dtype=torch.long)
    old = torch.zeros((b, r_max))
    for i, (p, s) in enumerate(rows):
        prompt_ids[i, p_max - len(p) :] = torch.tensor(p)
        prompt_mask[i, p_max - len(p) :] = 1
        completion_ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        completion_mask[i, : len(s.tokens)] = 1
        old[i, : len(s.tokens)] = torch.tensor(s.logprobs)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([float(s.advantage) for _, s in rows]),
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum(),
    }


def run_config(model_dir: str, P: int, R: int, n: int, groups: int, reps: int, progress) -> dict[str, Any]:
    floe_model = load_model(model_dir)
    vocab = floe_model.config.vocab_size
    batch = grpo_batch(vocab, P, R, n, groups, seed=P + R + n)
    spec = resolve_loss("ppo", {"aggregation": "token_mean", "clip_low": CLIP_LOW, "clip_high": CLIP_HIGH})
    zone = PolicyZone(floe_model, OptimizerConfig(lr=LR), ComputeConfig(max_tokens_per_microbatch=1 << 16))
    trainer = trl_trainer(model_dir, groups * n, n, R)
    trl_model = trainer.model
    trl_opt = torch.optim.AdamW([p for p in trl_model.parameters() if p.requires_grad], lr=LR)
    inputs = trl_inputs(batch, trainer.processing_class.pad_token_id or 0)

    # Same loss before any step.
    floe_loss = zone.forward_backward(batch, spec, temperature=1.0).metrics["loss"]
    zone.optimizer.zero_grad(set_to_none=True)
    zone.pending_calls = 0
    trl_loss = float(trainer.compute_loss(trl_model, inputs))
    trl_model.zero_grad(set_to_none=True)

    def floe_step() -> None:
        zone.forward_backward(batch, spec, temperature=1.0)
        zone.optim_step()

    def trl_step() -> None:
        loss = trainer.compute_loss(trl_model, inputs)
        loss.backward()
        trl_opt.step()
        trl_opt.zero_grad(set_to_none=True)

    times = time_interleaved({"floe": floe_step, "trl": trl_step}, reps, progress=progress)
    out = {"P": P, "R": R, "n": n, "groups": groups, "floe_loss": floe_loss, "trl_loss": trl_loss}
    out.update({arm: summary(t) for arm, t in times.items()})
    out["speedup"] = out["trl"]["min_s"] / out["floe"]["min_s"]
    return out


def plot(results: list[dict[str, Any]], name: str) -> None:
    two_bar_chart(
        name, [f"P{r['P']} R{r['R']} n{r['n']}" for r in results],
        ("TRL GRPOTrainer", [r["trl"]["min_s"] for r in results]),
        [r["floe"]["min_s"] for r in results], [f"{r['speedup']:.1f}×" for r in results],
        "seconds per training step (min of reps)", "GRPO training step, same model / batch / DAPO loss",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--groups", type=int, default=2)
    model_arguments(ap, "trl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(tiny_model_dir(args.hidden, args.layers))
    configs = [(1024, 128, 8)] if args.quick else [(1024, 128, 8), (512, 256, 8), (2048, 128, 16)]
    results = []
    with progress_bar() as progress:
        task = progress.add_task("configs", total=len(configs))
        for P, R, n in configs:
            progress.update(task, description=f"P={P} R={R} n={n}")
            r = run_config(model_dir, P, R, n, args.groups, args.reps, progress)
            results.append(r)
            progress.advance(task)
            progress.console.print(
                f"P={P} R={R} n={n}: TRL {r['trl']['min_s']:.2f}s floe {r['floe']['min_s']:.2f}s "
                f"-> {r['speedup']:.2f}x (loss floe {r['floe_loss']:.6f} trl {r['trl_loss']:.6f})"
            )
            write_json(args.name, {"model": {"hidden": args.hidden, "layers": args.layers}, "results": results})
    plot(results, args.name)


if __name__ == "__main__":
    main()
