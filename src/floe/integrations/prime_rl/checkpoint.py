"""`floe prime-trainer`'s side of prime-rl's `[ckpt]` and `resume`, laid out as prime-rl lays out its
trainer's (src/prime_rl/trainer/ckpt.py at `PRIME_RL_COMMIT`).

prime-rl writes `<ckpt root>/checkpoints/step_{N}/trainer/` (the trainer: weights, optimizer,
scheduler, progress) next to `step_{N}/orchestrator/` (the orchestrator's progress and data
position, which prime-rl's own orchestrator keeps). floe's trainer keeps the policy's state on
`floe serve`: at a checkpoint step it calls `save_state(<name>)` (weights, optimizer moments,
optimizer step, sampler version and RNG, atomically) and writes `step_{N}/trainer/floe.json`
(`TrainerCheckpoint`: the state's name, prime-rl's step, the weights version). The scheduler
needs no file: prime-rl's scheduler is rebuilt at the restored optimizer step (schedule.py).

Steps saved are prime-rl's: every `interval` steps and the last one; `keep_last` /
`keep_interval` delete older step directories and their floe states as prime-rl's
`CheckpointManager.maybe_clean` does. Resume: `resume.step` (or the latest `step_*` under the
checkpoint root) loads that step's state and continues at step + 1; `resume.dir` (another run's
`.../checkpoints/step_N`) does the same from that directory.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from floe.atomic import atomic_write_text
from floe.errors import InvalidInput, StateError

MARKER = "floe.json"


@dataclass(frozen=True)
class CkptConfig:
    """prime-rl's trainer `[ckpt]` keys floe's trainer applies (shared `ckpt` merged under `trainer.ckpt`)."""

    interval: int | None = None  # None: only the last step
    keep_last: int | None = None
    keep_interval: int | None = None
    output_dir: Path | None = None  # checkpoint root instead of the run directory


@dataclass(frozen=True)
class ResumeConfig:
    """prime-rl's `resume`: `step` (None: the latest checkpoint) or `dir` (`.../step_N` of any run)."""

    step: int | None = None
    dir: Path | None = None


@dataclass
class TrainerCheckpoint:
    """`checkpoints/step_N/trainer/floe.json`: floe serve holds the policy of prime-rl step `step` as state `state`."""

    step: int
    state: str
    weights_version: int
    policy_step: int
    model: str


def checkpoints_dir(run_dir: Path, ckpt: CkptConfig | None) -> Path:
    """`<ckpt.output_dir or run_dir>/checkpoints` (prime-rl's get_ckpt_dir)."""
    return Path(ckpt.output_dir if ckpt is not None and ckpt.output_dir is not None else run_dir) / "checkpoints"


def saved_steps(root: Path) -> list[int]:
    """Steps with a `step_N` directory under `root`, ascending (prime-rl's get_all_ckpt_steps)."""
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit()) if root.is_dir() else []


def state_name(run_dir: Path, step: int) -> str:
    """The floe state name of a run's step: `prime-<run dir name>-step_N`, within floe's name rules."""
    run = re.sub(r"[^A-Za-z0-9_.-]", "-", Path(run_dir).name)[:96] or "run"
    return f"prime-{run}-step_{step}"


def resume_step(resume: ResumeConfig, root: Path) -> int:
    """The step to resume from; StateError when `resume.step` is unset and nothing was saved."""
    if resume.dir is not None:
        return int(Path(resume.dir).name.removeprefix("step_"))
    if resume.step is not None:
        return resume.step
    steps = saved_steps(root)
    if not steps:
        raise StateError(f"resume: no checkpoint under {root} (checkpoints/step_N); set resume.step or start "
                         "a new run without resume")
    return steps[-1]


def read_checkpoint(step_dir: Path) -> TrainerCheckpoint:
    """The trainer checkpoint of `.../checkpoints/step_N`; InvalidInput naming `resume` when it is not one."""
    path = Path(step_dir) / "trainer" / MARKER
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidInput("resume", f"{path} does not exist: {step_dir} holds no floe trainer checkpoint (was the "
                           "run trained by floe prime-trainer with [ckpt]?)") from None
    except (OSError, ValueError) as e:
        raise InvalidInput("resume", f"{path} is not a floe trainer checkpoint: {e}") from None
    types = {"step": int, "state": str, "weights_version": int, "policy_step": int, "model": str}
    if not isinstance(data, dict) or set(data) != set(types) or any(type(data[k]) is not t for k, t in types.items()):
        raise InvalidInput("resume", f"{path} is not a floe trainer checkpoint: expected "
                           f"{', '.join(f'{k} ({t.__name__})' for k, t in types.items())}")
    return TrainerCheckpoint(**data)


def save(client: Any, root: Path, run_dir: Path, step: int, weights_version: int, model: str) -> TrainerCheckpoint:
    """`save_state` on the server, then `step_N/trainer/floe.json` (atomic; the marker last)."""
    saved = client.save_state(state_name(run_dir, step))
    ckpt = TrainerCheckpoint(step=step, state=saved.name, weights_version=weights_version, policy_step=saved.step,
                             model=model)
    out = root / f"step_{step}" / "trainer"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / MARKER, json.dumps(asdict(ckpt), indent=1) + "\n")
    return ckpt


def steps_to_delete(steps: list[int], ckpt: CkptConfig) -> list[int]:
    """prime-rl's maybe_clean: keep the last `keep_last` and every multiple of `keep_interval`;
    nothing is deleted when both are None."""
    if ckpt.keep_last is None and ckpt.keep_interval is None:
        return []
    keep = set(steps[-ckpt.keep_last:]) if ckpt.keep_last is not None else set()
    if ckpt.keep_interval is not None:
        keep |= {s for s in steps if s % ckpt.keep_interval == 0}
    return [s for s in steps if s not in keep]


def clean(client: Any, root: Path, ckpt: CkptConfig, steps: list[int]) -> list[int]:
    """Delete the trainer checkpoints (floe state and `step_N` directory) `steps_to_delete` names.
    `steps` are the steps this run knows of (prime-rl's ckpt_steps). Returns the steps deleted."""
    deleted = steps_to_delete(steps, ckpt)
    for step in deleted:
        step_dir = root / f"step_{step}"
        marker = step_dir / "trainer" / MARKER
        if marker.is_file():
            try:
                client.delete_state(read_checkpoint(step_dir).state)
            except StateError:
                pass  # already gone on the server: the directory still goes
        shutil.rmtree(step_dir, ignore_errors=True)
    return deleted
