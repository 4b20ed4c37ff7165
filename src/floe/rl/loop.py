"""The GRPO loop: sample groups, score them, compute advantages, train, sync, repeat.

It only uses the public client API, so it runs unchanged on any placement. One code path
serves both modes: a sampler thread produces the rollouts of step i once training has
finished step i - k (k = `max_off_policy_steps`), so with k = 0 sampling waits for the latest
weights (synchronous) and with k > 0 it runs up to k steps ahead, overlapping training. Every
sample records the weights version that produced it; staleness = trainer step - version.

Runs are resumable: a checkpoint saves the backend state and `loop_state.json`; `--resume`
loads the latest, truncates the JSONL outputs to that step and continues with the next one (a
damaged latest checkpoint is skipped, with a line saying so, for the run's newest older one
that loads).
Old checkpoints are pruned through `client.delete_state`, so a remote backend drops them too.
Step i's tasks and sampling seed derive from (seed, i), so a resumed synchronous run is the
run it would have been (with k > 0, which version a batch is sampled with depends on thread
timing, within the bound).
"""

from __future__ import annotations

import itertools
import json
import queue
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import floe
from floe.atomic import atomic_write_text
from floe.compute.losses import resolve_loss
from floe.errors import InvalidInput, StateError, WorkerFailed
from floe.rl.advantages import build_training_batch
from floe.rl.config import RESUMABLE_KEYS, Recipe, config_changes, is_resumable, loss_request
from floe.rl.evaluation import evaluate, rollout_record
from floe.rl.metrics import MetricsLogger, read_jsonl, truncate_jsonl
from floe.rl.preflight import check_recipe
from floe.rl.progress import RunProgress
from floe.rl.rollouts import Renderer, RolloutBatch, run_episodes
from floe.rl.warmstart import connect_recipe
from floe.types import Batch, SamplingParams


@dataclass
class RunSummary:
    run_dir: str
    steps_done: int
    eval_rewards: dict[int, float]
    seconds: float


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919) % (2**31)


class Trainer:
    def __init__(self, recipe: Recipe, resume: bool = False, progress: bool | None = None):
        self.recipe = recipe
        self.run_dir = Path(recipe.output.run_dir)
        self.resume = resume
        self.show_progress = recipe.output.progress if progress is None else progress
        # Checkpoint names carry the run's name, so runs sharing one (remote) backend never
        # overwrite or resume each other's states.
        self._checkpoint_prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", self.run_dir.resolve().name).lstrip(".") + "."
        self.steps_done = 0  # steps trained so far (the CLI reports it on Ctrl-C)
        # Set by the CLI's Ctrl-C handler. The KeyboardInterrupt it also raises is lost when the
        # signal lands in a finalizer or a GC callback (Python prints "Exception ignored" and goes
        # on), so the step loop checks this too and stops at the next step boundary.
        self.interrupted = threading.Event()
        self.checkpoint_step: int | None = None  # the step of the latest checkpoint, if any
        self._restart = False
        self._start_record: dict[str, Any] = {}  # the config_history.jsonl line of this start

    # -- setup ----------------------------------------------------------------------------

    def _prepare_run_dir(self) -> None:
        """Decide how the run starts (before any model loads); `_record_config` writes it down.

        A directory without metrics.jsonl starts fresh (`--resume` is refused: nothing to resume).
        One with metrics but no checkpoint (stopped before its first) restarts from step 0 with
        `--resume`; one with a checkpoint continues from it, after the new recipe is compared with
        the run's: only RESUMABLE_KEYS may differ. Without `--resume` both are refused, the
        message saying which `--resume` would do. Writes nothing."""
        metrics = self.run_dir / "metrics.jsonl"
        state_file = self.run_dir / "loop_state.json"
        checkpoint = json.loads(state_file.read_text()) if state_file.is_file() else None
        self.checkpoint_step = int(checkpoint["step"]) if checkpoint else None
        new = self.recipe.public_dump()
        changed: dict[str, Any] = {}
        if not metrics.exists():
            if self.resume:
                raise InvalidInput("--resume", f"no run in {self.run_dir} to resume (no metrics.jsonl); drop --resume to start it")
            self._restart = False
        elif not self.resume:
            what = (f"a run with a checkpoint at step {self.checkpoint_step}; pass --resume to continue it from there"
                    if checkpoint else "a run stopped before its first checkpoint; pass --resume to restart it from step 0")
            raise FileExistsError(f"{self.run_dir} already holds {what}, or set output.run_dir to start a new run")
        else:
            self._restart = checkpoint is None
            old_file = self.run_dir / "config.json"
            if checkpoint is not None and old_file.is_file():
                changed = config_changes(json.loads(old_file.read_text()), new)
                refused = [k for k in changed if not is_resumable(k)]
                if refused:
                    old, now = changed[refused[0]]
                    raise InvalidInput(
                        f"recipe.{refused[0]}",
                        f"was {json.dumps(old)} in the run being resumed, now {json.dumps(now)}; only "
                        f"{', '.join(RESUMABLE_KEYS)} may change on --resume (docs/recipes.md). Put the old value "
                        "back, or start a new run with another output.run_dir",
                    )
        start = 0 if checkpoint is None or not self.resume else self.checkpoint_step
        self._start_record = {"step": start, "changed": {k: list(v) for k, v in changed.items()}, "config": new}

    def _record_config(self) -> None:
        """Record the start `_prepare_run_dir` decided, once the backend answered (so a start that
        fails to connect leaves the run dir as it was): config.json is the current recipe;
        config_history.jsonl gets one line per start ({"step", "changed", "config"})."""
        record = self._start_record
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.json", json.dumps(record["config"], indent=2))
        with (self.run_dir / "config_history.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _resume_point(self, client: floe.Client) -> int:
        """Load the latest checkpoint; returns the number of steps already done (0 for a fresh
        run, and for a resumed run that had no checkpoint: its outputs are cleared)."""
        if not self.resume:
            return 0
        if self._restart:
            truncate_jsonl(self.run_dir / "metrics.jsonl", -1)
            truncate_jsonl(self.run_dir / "rollouts.jsonl", -1)
            return 0
        state = json.loads((self.run_dir / "loop_state.json").read_text())
        done = self._load_checkpoint(client, state["checkpoint"], int(state["step"]))
        truncate_jsonl(self.run_dir / "metrics.jsonl", done)
        truncate_jsonl(self.run_dir / "rollouts.jsonl", done)
        return done

    def _load_checkpoint(self, client: floe.Client, name: str, step: int) -> int:
        """Load the run's last checkpoint `name` (at `step`); returns the step loaded. When that
        state cannot be loaded (damaged: a file missing or cut short), the run's newest older
        checkpoint that loads is taken instead, saying which was skipped and why; the first
        error is raised when none loads. A worker failure is raised at once."""
        try:
            client.load_state(name)
            return step
        except WorkerFailed:
            raise
        except StateError as first:
            prefix = f"{self._checkpoint_prefix}step_"
            older = sorted((n for n in client.list_states() if n.startswith(prefix) and n < name), reverse=True)
            for candidate in older:
                try:
                    client.load_state(candidate)
                except WorkerFailed:
                    raise
                except StateError:
                    continue
                at = int(candidate.removeprefix(prefix))
                print(f"floe: the last checkpoint {name!r} (step {step}) could not be loaded ({first}); resuming from "
                      f"{candidate!r} (step {at}) instead", file=sys.stderr)
                return at
            raise

    def _checkpoint(self, client: floe.Client, step: int) -> None:
        name = f"{self._checkpoint_prefix}step_{step:06d}"
        client.save_state(name)
        atomic_write_text(self.run_dir / "loop_state.json", json.dumps({"step": step, "checkpoint": name}))
        self.checkpoint_step = step
        # Prune through the client, so a remote backend drops them too; only this run's states.
        ours = sorted(n for n in client.list_states() if n.startswith(f"{self._checkpoint_prefix}step_"))
        for old in ours[: -self.recipe.output.keep_checkpoints]:
            client.delete_state(old)

    # -- the run --------------------------------------------------------------------------

    def run(self, client: floe.Client | None = None) -> RunSummary:
        start_time = time.perf_counter()
        recipe, tr = self.recipe, self.recipe.train
        family = check_recipe(recipe, model=client is None)  # user errors before any model loads
        self._prepare_run_dir()
        if self.resume and self._restart:
            print(f"floe: {self.run_dir} has no checkpoint yet; restarting it from step 0", file=sys.stderr)
        ui = RunProgress(enabled=self.show_progress)
        own_client = client is None
        if client is None:
            client = connect_recipe(recipe, ui.warm_start)
        self._env_label = family.name
        try:
            renderer = self._renderer = Renderer(client.tokenizer())  # a remote backend's first call (auth)
            self._record_config()
        except BaseException:
            if own_client:
                client.close()
            raise
        scorer = ThreadPoolExecutor(max_workers=8, thread_name_prefix="floe-score")
        logger = MetricsLogger(self.run_dir, recipe.public_dump(), recipe.output.wandb,
                               recipe.output.tensorboard, recipe.output.wandb_project)
        eval_tasks = family.tasks("eval", recipe.eval.size, recipe.eval.seed)
        done = self._resume_point(client)
        self.steps_done = done
        # The sampler version trained step i would have if every earlier step synced once: the
        # reference for staleness, also on a backend that synced before this run started.
        self._version_base = client.info().sampler_version - done
        eval_rewards = {r["step"]: r["eval/reward_mean"] for r in read_jsonl(self.run_dir / "metrics.jsonl") if "eval/reward_mean" in r}
        if done == 0:
            ev = evaluate(client, family, eval_tasks, recipe, renderer, scorer)
            eval_rewards[0] = ev["eval/reward_mean"]
            logger.log({"step": 0, **ev})
        ui.start(total=tr.steps, done=done, eval_reward=eval_rewards.get(max(eval_rewards), None) if eval_rewards else None)

        sampler_client = client.fork()  # a second ordered stream, so sampling can overlap training
        rollouts: queue.Queue[tuple[int, RolloutBatch] | BaseException] = queue.Queue()
        trained = threading.Condition()
        steps_trained = [done]
        stop = threading.Event()

        def produce() -> None:
            try:
                for i in range(done, tr.steps):
                    with trained:
                        trained.wait_for(lambda i=i: steps_trained[0] >= i - tr.max_off_policy_steps or stop.is_set())
                    if stop.is_set():
                        return
                    tasks = family.tasks("train", tr.groups_per_step, step_seed(tr.seed, i))
                    params = SamplingParams(max_tokens=tr.max_tokens, temperature=tr.temperature,
                                            top_p=tr.top_p, seed=step_seed(tr.seed + 1, i))
                    rollouts.put((i, run_episodes(sampler_client, family, tasks, tr.samples_per_group,
                                                  params, renderer, scorer)))
            except BaseException as e:  # noqa: BLE001 - surfaced in the trainer thread, which raises it
                rollouts.put(e)

        producer = threading.Thread(target=produce, name="floe-rollouts", daemon=True)
        producer.start()
        try:
            for i in range(done, tr.steps):
                if self.interrupted.is_set():
                    raise KeyboardInterrupt
                item = rollouts.get()
                if isinstance(item, BaseException):
                    raise item
                step_index, batch = item
                assert step_index == i
                record = self._train_step(client, i, batch, logger)
                with trained:
                    steps_trained[0] = i + 1
                    trained.notify_all()
                step = i + 1
                self.steps_done = step
                if recipe.eval.every and step % recipe.eval.every == 0 or step == tr.steps:
                    ev = evaluate(client, family, eval_tasks, recipe, renderer, scorer)
                    record.update(ev)
                    eval_rewards[step] = ev["eval/reward_mean"]
                logger.log(record)
                every = recipe.output.checkpoint_every
                if (every and step % every == 0) or step == tr.steps:
                    self._checkpoint(client, step)
                ui.advance(record)
        finally:
            stop.set()
            with trained:
                trained.notify_all()
            producer.join(timeout=60)
            sampler_client.close()
            scorer.shutdown(wait=False)
            ui.stop()
            logger.close()
            if own_client:
                client.close()
        seconds = time.perf_counter() - start_time
        return RunSummary(str(self.run_dir), tr.steps, eval_rewards, seconds)

    def _train_step(self, client: floe.Client, i: int, rollouts: RolloutBatch, logger: MetricsLogger) -> dict[str, Any]:
        tr = self.recipe.train
        t0 = time.perf_counter()
        groups = rollouts.by_group()
        batch, dropped = build_training_batch(groups, tr.advantage)
        rewards = [e.reward for e in rollouts.episodes]
        versions = [t.weights_version for e in rollouts.episodes for t in e.turns]
        current = self._version_base + i  # the version the policy had when step i began
        record: dict[str, Any] = {
            "step": i + 1,
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            f"reward/{self._env_label}_mean": statistics.fmean(rewards),
            "groups_dropped": dropped,
            "tokens_sampled": sum(len(t.tokens) for e in rollouts.episodes for t in e.turns),
            "staleness_mean": statistics.fmean(current - v for v in versions),
            "staleness_max": max(current - v for v in versions),
            "weights_version_min": min(versions),
            "time/sample": rollouts.sample_seconds,
            "time/score": rollouts.score_seconds,
        }
        for key in sorted({k for e in rollouts.episodes for k in e.metrics}):
            record[f"env/{key}"] = statistics.fmean(e.metrics.get(key, 0.0) for e in rollouts.episodes)
        train_metrics: list[dict[str, float]] = []
        step_results = []
        if batch.groups:
            loss, loss_cfg = loss_request(tr.loss)
            if resolve_loss(loss, loss_cfg).needs_ref_logprobs:
                ref = client.forward(batch, zone="reference", temperature=tr.temperature)
                for g, lps in zip(batch.groups, ref.logprobs):
                    for s, lp in zip(g.samples, lps):
                        s.ref_logprobs = lp
            for part in _split_groups(batch, tr.minibatches):
                res = client.forward_backward(part, loss, loss_cfg, temperature=tr.temperature)
                train_metrics.append(res.metrics)
                step_results.append(client.optim_step())
        t1 = time.perf_counter()
        sync = client.sync_weights()
        t2 = time.perf_counter()
        if train_metrics:
            for key in ("loss", "entropy", "clip_fraction", "kl_sampler_k3", "kl_ref_k3", "ratio_max", "exp_bounded_tokens"):
                vals = [m[key] for m in train_metrics if key in m]
                if vals:
                    record[key] = statistics.fmean(vals)
            record["tokens_trained"] = sum(m["tokens"] for m in train_metrics)
            # The backend's own measurement of the step's forward_backward calls (docs/api.md).
            seconds = sum(m["seconds"] for m in train_metrics)
            record["time/forward_backward"] = seconds
            record["tokens_per_second"] = sum(m["sequence_tokens"] for m in train_metrics) / seconds
            if all("mfu" in m for m in train_metrics):  # the time-weighted mean = Σ model_flops / Σ seconds / peak
                record["mfu"] = sum(m["mfu"] * m["seconds"] for m in train_metrics) / seconds
            record["grad_norm"] = statistics.fmean(s.grad_norm for s in step_results)
            record["lr"] = step_results[-1].lr
            record["policy_step"] = step_results[-1].step
        record.update({"weights_version": sync.version, "sync_bytes": sync.bytes,
                       "time/train": t1 - t0, "time/sync": t2 - t1})
        if self.recipe.output.rollouts_per_step:
            logger.rollouts([rollout_record(i + 1, e, self._renderer, self._env_label)
                             for e in rollouts.episodes[: self.recipe.output.rollouts_per_step]])
        return record


def _split_groups(batch: Batch, parts: int) -> list[Batch]:
    n = len(batch.groups)
    parts = min(parts, n)
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [Batch(batch.groups[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


def train(recipe: Recipe, resume: bool = False, progress: bool | None = None) -> RunSummary:
    return Trainer(recipe, resume, progress).run()
