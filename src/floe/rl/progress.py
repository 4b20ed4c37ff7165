"""The console view of a run: warm-start progress, then a step bar with reward and speed.

On a terminal these are live rich progress bars; otherwise (logs, CI) plain lines are printed
as the run goes, so a redirected run still shows where it is.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    """`sft_label` names the SFT bar and lines: "warm start (SFT)" before RL, "sft" for `floe sft`."""

    def __init__(self, enabled: bool = True, sft_label: str = "warm start (SFT)"):
        self.enabled = enabled
        self.sft_label = sft_label
        self.console = Console(stderr=True)
        self._progress: Progress | None = None
        self._task = None
        self._warm: Progress | None = None
        self._warm_task = None
        self.live = self.console.is_terminal
        self._total = 0
        self._done = 0

    def _bar(self, label: str) -> Progress:
        return Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )

    def warm_start(self, step: int, total: int, loss: float) -> None:
        if not self.enabled:
            return
        if not self.live:
            if step == 1 or step % 20 == 0 or step == total:
                self.console.print(f"{self.sft_label} {step}/{total} loss {loss:.3f}", highlight=False)
            return
        if self._warm is None:
            self._warm = self._bar(self.sft_label)
            self._warm.start()
            self._warm_task = self._warm.add_task("sft", total=total, status="")
        self._warm.update(self._warm_task, completed=step, status=f"loss {loss:.3f}")
        if step >= total:
            self._warm.stop()

    def start(self, total: int, done: int, eval_reward: float | None) -> None:
        self._eval = eval_reward
        self._total, self._done = total, done
        if not self.enabled:
            return
        if not self.live:
            eval_text = f", held-out reward {eval_reward:.3f}" if eval_reward is not None else ""
            self.console.print(f"train: {done}/{total} steps done{eval_text}", highlight=False)
            return
        self._progress = self._bar("train")
        self._progress.start()
        status = f"eval {eval_reward:.3f}" if eval_reward is not None else ""
        self._task = self._progress.add_task("train", total=total, completed=done, status=status)

    def advance(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._done += 1
        if "eval/reward_mean" in record:
            self._eval = record["eval/reward_mean"]
        secs = sum(v for k, v in record.items() if k.startswith("time/"))
        status = f"reward {record['reward_mean']:.3f}"
        if self._eval is not None:
            status += f" | eval {self._eval:.3f}"
        status += f" | {secs:.1f}s/step"
        if self._progress is not None:
            self._progress.update(self._task, advance=1, status=status)
        else:
            self.console.print(f"step {self._done}/{self._total} {status}", highlight=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
