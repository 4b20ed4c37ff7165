"""What of the Tinker service is in memory, and what waits on disk.

Runs and samplers live as long as their session; memory holds at most `max_runs` training runs,
`max_samplers` samplers and `max_bases` base models (`[server] tinker_max_live_*`). Beyond
that the least recently used one leaves memory, exactly:
* a run is **offloaded**: its state (trained weights, AdamW moments, step, RNG) is written to
  `Layout.live(run)` and the run closed; it is loaded back, exactly, on its next request. A run
  with gradients waiting for `optim_step` stays (its pending gradients are not state that
  `save_state` keeps);
* a snapshot sampler's weights are written to `Layout.snapshot(run, sampler)` and freed; a
  checkpoint or base-model sampler is just freed (its weights are on disk already). Each comes
  back when asked for;
* a base model leaves when none of its runs or samplers is in use: they leave first.
Something in use (inside `run()` / `sampler()`) never leaves; the bounds can then be passed for
a while. `offload_all()` (server shutdown) offloads every run, so a restart continues them.

Base models are `RunManager`s by name (`floe.backend.runs`), each loading its model on first use.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from floe.backend.runs import RunManager, SamplerInfo
from floe.errors import StateError
from floe.server.protocols.tinker.store import Layout, RunRow, SamplerRow, Store

log = logging.getLogger("floe.server.tinker")

__all__ = ["Residency"]


@dataclass(frozen=True)
class _Held:
    """A sampler's weights in memory: its base, the weights, and whether leaving memory must
    write them to disk first (a snapshot; others are on disk already)."""

    base: str
    info: SamplerInfo
    spill: bool


class Residency:
    """See the module docstring. `checkpoint_dir(model_path)` gives a sampler checkpoint's
    directory; `next_seq(run_id)` a run's next seq_id (kept with its offloaded state)."""

    def __init__(self, bases: dict[str, RunManager], layout: Layout, store: Store, max_runs: int, max_samplers: int,
                 max_bases: int, checkpoint_dir: Callable[[str], Path], next_seq: Callable[[str], int]):
        self.bases = bases
        self.layout = layout
        self.store = store
        self.max_runs, self.max_samplers, self.max_bases = max_runs, max_samplers, max_bases
        self.checkpoint_dir = checkpoint_dir
        self.next_seq = next_seq
        self._lock = threading.RLock()
        self._runs: OrderedDict[str, str] = OrderedDict()  # run id -> base, least recently used first
        self._samplers: OrderedDict[str, _Held] = OrderedDict()  # residency key -> weights in memory
        self._bases: OrderedDict[str, None] = OrderedDict()  # bases in memory
        self._pins: Counter[str] = Counter()

    # -- counts (metrics, tests) -----------------------------------------------------------------

    @property
    def live_runs(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    @property
    def live_samplers(self) -> list[str]:
        with self._lock:
            return list(self._samplers)

    @property
    def live_bases(self) -> list[str]:
        with self._lock:
            return list(self._bases)

    def memory(self) -> dict[str, int]:
        """What is in memory now (the server's metrics): the runs, samplers and base models this
        residency holds, and what the base models' managers really hold (`RunManager.in_memory`:
        loaded base models, LoRA adapters, whole models). Counts read without the lock, which a
        restore holds while it reads from disk: a scrape never waits for one."""
        out = {"runs": len(self._runs), "samplers": len(self._samplers), "bases": len(self._bases)}
        for manager in self.bases.values():
            for key, count in manager.in_memory().items():
                out[key] = out.get(key, 0) + count
        return out

    # -- bases ---------------------------------------------------------------------------------

    def manager(self, base: str) -> RunManager:
        """The base model's manager, marked used (its model loads on first use)."""
        with self._lock:
            self._bases[base] = None
            self._bases.move_to_end(base)
        return self.bases[base]

    # -- runs ----------------------------------------------------------------------------------

    def added_run(self, run_id: str, base: str) -> None:
        """A run just created or loaded in memory by the base's manager."""
        with self._lock:
            self._runs[run_id] = base
            self._runs.move_to_end(run_id)
        self.store.update_run(run_id, status="live")
        self._evict()

    @contextmanager
    def run(self, row: RunRow) -> Iterator[RunManager]:
        """The run in memory (loaded back if it was offloaded) and pinned there while inside."""
        with self._lock:
            self._pins[row.id] += 1
            try:
                manager = self.manager(row.base)
                if row.id not in self._runs:
                    self._restore(row, manager)
                self._runs.move_to_end(row.id)
            except BaseException:
                self._unpin(row.id)
                raise
        try:
            yield manager
        finally:
            with self._lock:
                self._unpin(row.id)
            self._evict()

    def _restore(self, row: RunRow, manager: RunManager) -> None:
        now = self.store.run_any(row.id)
        status = now.status if now is not None else "closed"
        if status != "offloaded":
            why = {"closed": "its session finished", "lost": "the server stopped without saving it (a crash or kill)"}
            raise StateError(f"training run {row.id!r} is no longer live: {why.get(status, status)}; continue from a "
                             "checkpoint (create_training_client_from_state with its last save_state path)")
        manager.load_state(row.id, self.layout.live(row.id), with_optimizer=True)
        self._runs[row.id] = row.base
        self.store.update_run(row.id, status="live")
        log.info("run loaded back", extra={"run": row.id})

    def drop_run(self, run_id: str, base: str) -> None:
        """Forget a run (its session finished): out of memory, its offloaded state deleted."""
        with self._lock:
            if self._runs.pop(run_id, None) is not None:
                self.bases[base].close_run(run_id)
        shutil.rmtree(self.layout.live(run_id), ignore_errors=True)

    def _offload_run(self, run_id: str) -> bool:
        base = self._runs[run_id]
        manager = self.bases[base]
        if manager.pending_calls(run_id):
            return False
        manager.save_state(run_id, self.layout.live(run_id))
        # The registry first: should writing it fail, the run stays live in memory and the
        # registry still says so (freeing the run first left it gone but recorded live).
        self.store.update_run(run_id, status="offloaded", next_seq=self.next_seq(run_id))
        manager.close_run(run_id)
        del self._runs[run_id]
        log.info("run offloaded", extra={"run": run_id})
        return True

    # -- samplers ------------------------------------------------------------------------------

    @staticmethod
    def key(row: SamplerRow) -> str:
        """Samplers that share weights share a key: a run's inflight samplers share its one
        inflight target."""
        return f"inflight:{row.run_id}" if row.kind == "inflight" else row.id

    def added_snapshot(self, row: SamplerRow, info: SamplerInfo) -> None:
        """A run's weights just frozen in memory for a snapshot or inflight sampler (an inflight
        target's earlier weights are freed)."""
        key = self.key(row)
        with self._lock:
            old = self._samplers.pop(key, None)
            if old is not None:
                self.bases[old.base].release_sampler(old.info)
            shutil.rmtree(self._spill_dir(row.run_id, key), ignore_errors=True)  # an inflight target's older weights  # type: ignore[arg-type]
            self._samplers[key] = _Held(row.base, info, spill=True)
        self._evict()

    @contextmanager
    def sampler(self, row: SamplerRow) -> Iterator[tuple[RunManager, SamplerInfo]]:
        """The sampler's weights in memory (loaded back if they left) and pinned there while inside."""
        key = self.key(row)
        with self._lock:
            self._pins[key] += 1
            try:
                manager = self.manager(row.base)
                if key not in self._samplers:
                    # Loaded from disk: its files stay there, so leaving memory again writes nothing.
                    self._samplers[key] = _Held(row.base, self._load_sampler(row, manager), spill=False)
                self._samplers.move_to_end(key)
                info = self._samplers[key].info
            except BaseException:
                self._unpin(key)
                raise
        try:
            yield manager, info
        finally:
            with self._lock:
                self._unpin(key)
            self._evict()

    def _load_sampler(self, row: SamplerRow, manager: RunManager) -> SamplerInfo:
        if row.kind == "base":
            return manager.base_sampler()
        if row.kind == "checkpoint":
            return manager.load_sampler(self.checkpoint_dir(row.model_path))  # type: ignore[arg-type]
        spilled = self._spill_dir(row.run_id, self.key(row))  # type: ignore[arg-type]
        if not spilled.is_dir():
            raise StateError("this sampler's weights were lost when the server stopped (a crash or kill); save weights "
                             "for a sampler again")
        return manager.load_sampler(spilled)

    def drop_sampler(self, row: SamplerRow) -> None:
        """Free a sampler (its session finished) and delete its spilled weights."""
        key = self.key(row)
        with self._lock:
            held = self._samplers.pop(key, None)
            if held is not None:
                self.bases[held.base].release_sampler(held.info)
        if row.run_id is not None and row.kind in ("snapshot", "inflight"):
            shutil.rmtree(self._spill_dir(row.run_id, key), ignore_errors=True)

    def _spill_dir(self, run_id: str, key: str) -> Path:
        return self.layout.snapshot(run_id, key.replace(":", "_"))

    def _spill_sampler(self, key: str) -> None:
        held = self._samplers[key]
        manager = self.bases[held.base]
        if held.spill:  # a snapshot: its weights exist nowhere else
            manager.save_sampler(held.info, self._spill_dir(held.info.run_id, key))  # type: ignore[arg-type]
        del self._samplers[key]
        manager.release_sampler(held.info)

    # -- eviction ------------------------------------------------------------------------------

    def _unpin(self, key: str) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]

    def _evict(self) -> None:
        """Move least recently used things out of memory until the bounds hold (or only things
        in use are left)."""
        with self._lock:
            for run_id in list(self._runs):
                if len(self._runs) <= self.max_runs:
                    break
                if self._pins[run_id] == 0:
                    self._offload_run(run_id)
            for key in list(self._samplers):
                if len(self._samplers) <= self.max_samplers:
                    break
                if self._pins[key] == 0:
                    self._spill_sampler(key)
            for base in list(self._bases):
                if len(self._bases) <= self.max_bases:
                    break
                self._unload_base(base)

    def _unload_base(self, base: str) -> None:
        runs = [r for r, b in self._runs.items() if b == base]
        samplers = [k for k, held in self._samplers.items() if held.base == base]
        if any(self._pins[k] for k in runs + samplers):
            return
        if not all(self._offload_run(r) for r in runs):
            return
        for key in samplers:
            self._spill_sampler(key)
        self.bases[base].unload()
        del self._bases[base]
        log.info("base model unloaded", extra={"base": base})

    def offload_all(self) -> None:
        """Offload every run and spill every snapshot (server shutdown): a restart continues
        them. A run with gradients waiting for optim_step cannot be offloaded; it is lost."""
        with self._lock:
            for key in list(self._samplers):
                try:
                    self._spill_sampler(key)
                except Exception:
                    log.exception("could not save a sampler at shutdown", extra={"sampler": key})
            for run_id in list(self._runs):
                try:
                    if not self._offload_run(run_id):
                        log.warning("run lost at shutdown: gradients were waiting for optim_step", extra={"run": run_id})
                except Exception:
                    log.exception("could not offload a run at shutdown", extra={"run": run_id})
