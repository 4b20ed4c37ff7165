"""Run outputs: metrics.jsonl (always), readable rollouts, optional W&B / TensorBoard.

Resuming truncates both JSONL files to the checkpointed step, so every step appears exactly
once however often a run is interrupted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from floe.atomic import atomic_write_text


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (used on resume), rewriting the file atomically
    (a crash during resume leaves the old file). A torn last line, left by a run killed while
    appending, is dropped: it belongs to a step after the checkpoint."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    def __init__(self, run_dir: Path, config: dict[str, Any], wandb: bool, tensorboard: bool, project: str):
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        self._wandb = self._tb = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise RuntimeError("output.wandb = true needs the wandb package: pip install 'floe-rl[wandb]'") from None
            self._wandb = wandb_module.init(project=project, config=config, dir=str(run_dir), resume="allow")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeError("output.tensorboard = true needs tensorboard: pip install 'floe-rl[tensorboard]'") from None
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = int(record.get("step", 0))
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)

    def rollouts(self, records: list[dict[str, Any]]) -> None:
        with self.rollouts_path.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
