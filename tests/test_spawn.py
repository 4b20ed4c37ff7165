"""tests/spawn.py's run_ranks: a native abort in a rank gets one fresh retry, nothing else does.

The ranks here are trivial (no torch.distributed); each writes a marker file, so a test can
tell how many attempts ran, and aborts (os.abort: SIGABRT, what gloo's std::terminate does)
or raises on cue.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from tests.spawn import run_ranks


def _rank(rank: int, world: int, work: str, mode: str) -> None:
    attempt = len(list(Path(work).glob(f"rank{rank}-*")))
    (Path(work) / f"rank{rank}-{attempt}").touch()
    if rank == 1 and (mode == "abort_always" or (mode == "abort_once" and attempt == 0)):
        os.abort()
    if rank == 1 and mode == "raise":
        raise ValueError("a rank's own error")


def test_an_abort_once_is_retried_with_a_fresh_rendezvous(tmp_path: Path) -> None:
    rendezvous = tmp_path / "rdzv"
    rendezvous.write_text("stale")
    with pytest.warns(UserWarning, match="killed by SIGABRT"):
        run_ranks(_rank, 2, (str(tmp_path), "abort_once"), timeout_s=120, rendezvous=[rendezvous])
    assert not rendezvous.exists()
    # rank 1 ran twice; rank 0 once or twice (the abort may end the first attempt before rank 0 starts)
    assert sorted(p.name for p in tmp_path.glob("rank1-*")) == ["rank1-0", "rank1-1"]
    assert 1 <= len(list(tmp_path.glob("rank0-*"))) <= 2


def test_a_second_abort_fails(tmp_path: Path) -> None:
    with pytest.warns(UserWarning), pytest.raises(ProcessExitedException, match="SIGABRT"):
        run_ranks(_rank, 2, (str(tmp_path), "abort_always"), timeout_s=120)
    assert len(list(tmp_path.glob("rank1-*"))) == 2


def test_a_python_error_is_not_retried(tmp_path: Path) -> None:
    with pytest.raises(ProcessRaisedException, match="a rank.s own error"):
        run_ranks(_rank, 2, (str(tmp_path), "raise"), timeout_s=120)
    assert [p.name for p in tmp_path.glob("rank1-*")] == ["rank1-0"]
