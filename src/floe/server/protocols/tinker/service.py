"""The Tinker protocol's operations: sessions, training runs, samplers, checkpoints, futures.

`TinkerService` turns decoded requests of a `Principal` into work on the base models'
`floe.backend.runs.RunManager`s and replies in the shapes the tinker 0.38 SDK validates.

Tenancy: every session, run, sampler and checkpoint has the principal that made it as owner
(`store.Store`, which answers every lookup for the asking principal: others' things are
`NotFound`, except checkpoints their owner published, which others may read, load and sample
from). Ids: a session id is made by the server; a training run is `<session>:train:<seq>` and a
sampler `<session>:sample:<seq>` (the SDK derives them itself), accepted only for a session the
principal owns; checkpoints are `tinker://<run id>/<kind>/<name>` with a client-chosen name
checked by `floe.names.check_name`. Files live under `<state_dir>/.tinker` (`store.Layout`),
a namespace no native state name can reach.

Memory: `residency.Residency` keeps at most `[server] tinker_max_live_*` runs, samplers and base
models in memory and moves the rest to disk exactly. Sessions that stop their heartbeat for
`[server] tinker_session_timeout_s` end like finished ones (their runs and samplers are freed;
checkpoints stay). Expired checkpoints (`ttl_seconds`) are deleted.

Base models: `[backend] model` (also known by `[server] served_model_name`) is the default, and
`[server] tinker_base_models` adds more; each loads on first use.

With `[server] tinker_full_finetune = true`, `create_model` makes full fine-tune runs (every
weight of the run's own model copy trains; `floe.backend.runs`): the SDK always sends a
`lora_config`, whose rank and seed then do not apply and whose module switches must stay on.

A failed operation is answered through its future as `{"error", "category": "user"}` (bad
input, wrong state) or `"server"` (anything else), which the SDK raises as `RequestFailedError`
without retrying. No message shows a server path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from floe.backend.runs import RunManager
from floe.backend.state import read_meta
from floe.compute.losses import TokenInputs, compute_loss, resolve_loss
from floe.errors import FloeError, InvalidInput, NotFound, StateError
from floe.models.lora import LoraSpec
from floe.names import check_name
from floe.server.principals import Principal
from floe.server.protocols.tinker import convert, requests, schema
from floe.server.protocols.tinker.futures import Futures, Reply, Sequencer
from floe.server.protocols.tinker.residency import Residency
from floe.server.protocols.tinker.stability import SETTING as STABILITY_SETTING
from floe.server.protocols.tinker.stability import StabilityRecords
from floe.server.protocols.tinker.store import Checkpoint, Layout, RunRow, SamplerRow, SessionRow, Store

log = logging.getLogger("floe.server.tinker")

JSON = "application/json"
PROTO = "application/x-protobuf"
VERSION_HEADER = "X-Floe-Weights-Version"


def json_reply(payload: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
    return Reply(200, json.dumps(payload).encode(), JSON, headers or {})


@dataclass(frozen=True)
class Bounds:
    """Per-request bounds (`[server] tinker_max_*`), checked before any work starts."""

    samples_per_request: int = 1024
    sampled_tokens_per_request: int = 1 << 20  # num_samples x max_tokens
    session_timeout_s: float = 600.0
    gap_timeout_s: float = 30.0
    min_ttl_s: int = 3600  # the shortest checkpoint ttl_seconds ([server] tinker_min_ttl_s)
    stability_tokens: int = 1 << 23  # recorded tokens of stability info per key (stability.py)
    queued_per_key: int = 256  # requests a key has accepted but not started ([server] tinker_max_queued_per_key)
    queued_mb_per_key: int = 1024  # their forward_backward bodies, MiB ([server] tinker_max_queued_mb_per_key)


def _path_pattern(root: Path) -> re.Pattern[str]:
    """Every spelling of `root` an error message may carry (as configured, which is relative by
    default; absolute; resolved through symlinks) and the rest of the path after it: paths built
    from the configured root are not resolved, so matching only the resolved one let them out."""
    spellings = {str(root), str(root.absolute()), str(root.resolve())}
    alternatives = "|".join(re.escape(s) for s in sorted(spellings, key=len, reverse=True))
    # A spelling counts only at the start of a path (not inside a longer name) and where a path
    # component ends, so a relative root such as "floe_state/.tinker" does not match prose.
    return re.compile(rf"(?<![\w./-])(?:{alternatives})(?=$|[/\s'\"])[^\s'\"]*")


class TinkerService:
    """Everything behind the /api/v1 routes (see the module docstring). `bases`: manager per
    base-model key; `names`: every accepted base-model name -> its key (the first key is the
    default)."""

    def __init__(self, bases: dict[str, RunManager], names: dict[str, str], tokenizer_ids: dict[str, str],
                 root: Path, bounds: Bounds, store: Store, max_live: tuple[int, int, int], full_finetune: bool):
        self.bases = bases
        self.names = names
        self.tokenizer_ids = tokenizer_ids
        self.bounds = bounds
        self.full_finetune = full_finetune
        self.layout = Layout(root)
        self.store = store
        self.futures = Futures(max_queued_per_owner=bounds.queued_per_key,
                               max_queued_bytes_per_owner=bounds.queued_mb_per_key << 20)
        self.stability = StabilityRecords(bounds.stability_tokens)
        self.sequencers: dict[str, Sequencer] = {}
        self._seq_lock = threading.Lock()
        self._storage = _path_pattern(Path(root))
        runs, samplers, base_models = max_live
        self.residency = Residency(bases, self.layout, store, runs, samplers, base_models,
                                   checkpoint_dir=self._checkpoint_dir, next_seq=self._next_seq)
        for status in ("live", "creating"):  # the server stopped without offloading them (or creating them)
            for row in store.runs_with_status(status):
                store.update_run(row.id, status="lost")
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="floe-tinker-sweep", daemon=True)
        self._sweeper.start()

    # -- answers -----------------------------------------------------------------------------------

    def scrub(self, text: str) -> str:
        """`text` without server paths (a client never learns where the server keeps files)."""
        return self._storage.sub("<server storage>", text)

    def failure(self, exc: BaseException) -> Reply:
        """A failed operation, as the SDK expects it from retrieve_future."""
        if isinstance(exc, (InvalidInput, StateError, FloeError)):
            return json_reply({"error": self.scrub(str(exc)), "category": "user"})
        log.exception("tinker operation failed", exc_info=exc)
        return json_reply({"error": self.scrub(f"{type(exc).__name__}: {exc}"), "category": "server"})

    def guarded(self, job: Callable[[], Reply]) -> Callable[[], Reply]:
        def run() -> Reply:
            try:
                return job()
            except BaseException as exc:  # noqa: BLE001 - every failure is answered through the future
                return self.failure(exc)

        return run

    # -- base models ---------------------------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        return list(self.names)

    def base_key(self, name: Any, field_name: str = "base_model") -> str:
        key = self.names.get(name) if isinstance(name, str) else None
        if key is None:
            raise InvalidInput(field_name, f"this server serves {self.model_names}; got {str(name)[:200]!r}")
        return key

    def _checkpoint_dir(self, model_path: str) -> Path:
        run_id, kind, name = requests_path(model_path)
        return self.layout.checkpoint(run_id, kind, name, field="model_path")

    # -- sessions ---------------------------------------------------------------------------

    def create_session(self, who: Principal, req: requests.CreateSession) -> dict[str, Any]:
        sid = uuid.uuid4().hex[:16]
        now = time.time()
        self.store.add_session(SessionRow(sid, who.id, list(req.tags), dict(req.user_metadata or {}), req.display_name,
                                          req.project_id, now, now, False))
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, who: Principal, session_id: str) -> bool:
        """False when the session finished (the SDK then stops its heartbeat)."""
        session = self.store.session(session_id, who)
        if not session.finished:
            self.store.touch_session(session.id, time.time())
        return not session.finished

    def _open_session(self, who: Principal, session_id: Any) -> SessionRow:
        session = self.store.session(session_id, who)
        if session.finished:
            raise StateError(f"session {session.id!r} has finished; start a new ServiceClient")
        self.store.touch_session(session.id, time.time())
        return session

    def finish(self, who: Principal, session_id: str) -> None:
        self._end_session(self.store.session(session_id, who))

    def _end_session(self, session: SessionRow) -> None:
        """The session's runs and samplers leave memory and disk (checkpoints stay); its runs
        without a checkpoint leave the registry too (`_forget_unused`)."""
        self.store.finish_session(session.id, time.time())
        self.stability.drop_session(session.id)
        for row in self.store.session_samplers(session.id):
            self.residency.drop_sampler(row)
        for run in self.store.session_runs(session.id):
            with self._seq_lock:
                seq = self.sequencers.pop(run.id, None)
            if seq is not None:
                seq.close()
            self.residency.drop_run(run.id, run.base)
            if run.status in ("live", "offloaded"):
                self.store.update_run(run.id, status="closed")
        self._forget_unused()

    def get_session(self, who: Principal, session_id: str) -> dict[str, Any]:
        session = self.store.session(session_id, who)
        return {"training_run_ids": [r.id for r in self.store.session_runs(session.id)],
                "sampler_ids": [s.id for s in self.store.session_samplers(session.id)],
                "user_metadata": {k: str(v) for k, v in session.user_metadata.items()},
                "display_name": session.display_name}

    def list_sessions(self, who: Principal, offset: int, limit: int) -> dict[str, Any]:
        rows, _ = self.store.sessions(who, offset, limit)
        return {"sessions": [r.id for r in rows]}

    # -- background --------------------------------------------------------------------------

    def _sweep_loop(self) -> None:
        interval = min(30.0, self.bounds.session_timeout_s / 4, float(self.bounds.min_ttl_s))
        while not self._stop.wait(interval):
            try:
                self.sweep(time.time())
            except Exception:
                log.exception("tinker sweep failed")

    def sweep(self, now: float) -> None:
        """End sessions idle past the timeout; delete expired checkpoints."""
        for sid in self.store.idle_sessions(now - self.bounds.session_timeout_s):
            session = self.store.session_any(sid)
            if session is not None:
                log.info("session expired", extra={"session": sid})
                self._end_session(session)
        for ckpt in self.store.expired_checkpoints(now):
            self._delete_checkpoint_files(ckpt)
            self.store.remove_checkpoint(ckpt)
        # A finished session's id answers 410 / "has finished" for one more timeout, then goes.
        self.store.forget_finished_sessions(now - self.bounds.session_timeout_s)
        self._forget_unused()

    def _forget_unused(self) -> None:
        """Runs that can never train again and hold no checkpoint leave the registry and the
        disk (store.forget_unused_runs): a key's registry stays bounded by its limits (a
        `tinker checkpoint download` export run goes when the CLI closes its session)."""
        for run_id in self.store.forget_unused_runs():
            shutil.rmtree(self.layout.run_dir(run_id), ignore_errors=True)

    def close(self) -> None:
        """Shutdown: offload every run (a restart continues them), stop the workers."""
        self._stop.set()
        self.residency.offload_all()
        self.futures.close()
        self.store.close()

    # -- training runs ----------------------------------------------------------------------

    def _next_seq(self, run_id: str) -> int:
        with self._seq_lock:
            seq = self.sequencers.get(run_id)
        return seq.next_seq if seq is not None else 1

    def _sequencer(self, row: RunRow) -> Sequencer:
        with self._seq_lock:
            seq = self.sequencers.get(row.id)
            if seq is None:
                # A run that cannot come back (lost in a crash or kill, or closed) answers every
                # request at once, with its error: its recorded next seq_id is stale, and waiting
                # for the numbers in between would hold each request for the gap timeout first.
                first = row.next_seq if row.status not in ("lost", "closed") else 2**63
                seq = Sequencer(self.futures, row.owner, self.bounds.gap_timeout_s, first_seq=first)
                self.sequencers[row.id] = seq
            return seq

    @contextmanager
    def _refusing(self, row: RunRow, seq_id: int | None) -> Iterator[None]:
        """The checks of a request of `row`'s sequence that run before it is queued: a refusal
        (InvalidInput, a 422 or 404) gives its seq_id up (Sequencer.skip), because the SDK moves on
        to the next seq_id and that one must not wait the gap timeout for a request that never
        comes. `row` is the caller's own run (resolved first), so nobody skips another's sequence."""
        try:
            yield
        except InvalidInput:
            self._sequencer(row).skip(seq_id)
            raise

    def _run(self, who: Principal, model_id: Any) -> RunRow:
        row = self.store.run(model_id, who)
        self.store.update_run(row.id, last_request=time.time())
        return row

    def _new_run(self, who: Principal, session_id: str, model_seq_id: int, base_model: str, digest: bytes,
                 lora: dict[str, Any] | None, user_metadata: dict[str, Any], job: Callable[[RunRow], Reply]) -> dict[str, Any]:
        """Register run `<session>:train:<seq>` (owned by `who`) and run `job` as its seq 0."""
        session = self._open_session(who, session_id)
        model_id = check_name(f"{session.id}:train:{model_seq_id}", "model_seq_id")
        existing = self.store.run_any(model_id)
        if existing is not None:  # a retried create: the first request's id (409 for other data)
            with self._seq_lock:
                seq = self.sequencers.get(model_id)
            if seq is None or 0 not in seq.seen:
                raise StateError(f"training run {model_id!r} exists already; a new run needs a new model_seq_id")
            return {"request_id": seq.submit(0, self.guarded(lambda: json_reply({})), digest), "model_id": model_id}
        key = self.base_key(base_model)
        now = time.time()
        row = RunRow(model_id, who.id, session.id, base_model, key, lora, dict(user_metadata), now, now, "creating", 1, 0)
        self.store.add_run(row)
        sequencer = self._sequencer(row)

        def create() -> Reply:
            try:
                return job(row)
            except BaseException:
                self.store.update_run(model_id, status="closed")  # the run never started
                raise

        return {"request_id": sequencer.submit(0, self.guarded(create), digest), "model_id": model_id}

    def create_model(self, who: Principal, req: requests.CreateModel, digest: bytes) -> dict[str, Any]:
        if req.optimizer_config.type != "adamw":
            raise InvalidInput("optimizer_config.type", f"floe trains with adamw only, got {req.optimizer_config.type!r}")
        lora = req.lora_config or requests.LoraConfig(rank=32, seed=None)
        if self.full_finetune:
            for key in ("train_attn", "train_mlp", "train_unembed"):
                if getattr(lora, key) is not True:
                    raise InvalidInput(f"lora_config.{key}", "this server trains full fine-tune runs ([server] "
                                       "tinker_full_finetune = true), which train every weight; leave it true")
            spec = None
        else:
            spec = LoraSpec(rank=lora.rank, seed=lora.seed, train_attn=lora.train_attn, train_mlp=lora.train_mlp,
                            train_unembed=lora.train_unembed)
            spec.check()

        def job(row: RunRow) -> Reply:
            manager = self.residency.manager(row.base)
            manager.create_run(row.id, spec, row.user_metadata)
            self.residency.added_run(row.id, row.base)
            return json_reply({"type": "create_model", "model_id": row.id})

        return self._new_run(who, req.session_id, req.model_seq_id, req.base_model, digest,
                             None if spec is None else spec.to_json(), req.user_metadata or {}, job)

    @staticmethod
    def _lora_fields(row: RunRow) -> dict[str, Any]:
        """is_lora / lora_rank of a run as the SDK's responses carry them."""
        return {"is_lora": False} if row.lora is None else {"is_lora": True, "lora_rank": int(row.lora["rank"])}

    def get_info(self, who: Principal, model_id: str) -> dict[str, Any]:
        row = self.store.run(model_id, who)
        return {
            "type": "get_info", "model_id": row.id, **self._lora_fields(row),
            "model_name": row.base_model, "optimizer_config": {"type": "adamw"},
            "model_data": {"model_name": row.base_model, "tokenizer_id": self.tokenizer_ids[row.base], "arch": "causal_lm"},
        }

    def forward_backward(self, who: Principal, body: bytes) -> dict[str, Any]:
        request = schema.ForwardBackwardRequest()
        try:
            request.ParseFromString(body)
        except Exception as exc:  # noqa: BLE001 - any decode failure is the client's bad body
            raise InvalidInput("body", f"not a ForwardBackwardRequest protobuf: {type(exc).__name__}") from None
        row = self._run(who, request.model_id)
        with self._refusing(row, request.seq_id or None):
            convert.check_forward_tokens(request, self.bases[row.base].vocab_size)  # refused now, not in the future
        forward_only = request.forward_only

        def job() -> Reply:
            call = convert.forward_request_to_floe(request, lambda sid: self.stability.get(who, sid),
                                                   self.bounds.stability_tokens, self.bases[row.base].vocab_size)
            with self.residency.run(row) as manager:
                # Targets that are not the next input token first: it checks them, and changes nothing.
                exact = manager.target_logprobs(row.id, call.target_queries())
                if forward_only:
                    logprobs = call.patched([g[0] for g in manager.forward(row.id, call.batch).logprobs], exact)
                    metrics = {"loss:sum": self._forward_loss(call, logprobs)}
                else:
                    result = manager.forward_backward(row.id, call.batch, call.loss, call.loss_config)
                    logprobs = call.patched([g[0] for g in result.logprobs], exact)
                    metrics = {"loss:sum": result.metrics["loss"]}
            return Reply(200, convert.forward_output(logprobs, metrics), PROTO)

        rid = self._sequencer(row).submit(request.seq_id or None, self.guarded(job), _digest(body), size=len(body))
        return {"request_id": rid, "model_id": row.id}

    @staticmethod
    def _forward_loss(call: convert.FloeCall, logprobs: list[list[float]]) -> float:
        """The summed loss of the scored log-probs, without gradients (floe's loss)."""
        import torch  # noqa: PLC0415 - only forward-only requests need it here

        spec = resolve_loss(call.loss, call.loss_config)
        samples = [g.samples[0] for g in call.batch.groups]
        flat = lambda values: torch.tensor([v for vs in values for v in vs], dtype=torch.float32)
        lens = [len(s.tokens) for s in samples]
        inputs = TokenInputs(
            logp=flat(logprobs),
            weights=flat([s.weights or [1.0] * n for s, n in zip(samples, lens)]),
            scale=torch.ones(sum(lens)),
            sample_index=torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lens)),
            num_samples=len(samples),
            old_logp=flat([s.logprobs for s in samples]) if spec.needs_old_logprobs else None,  # type: ignore[misc]
            advantages=flat([s.advantage for s in samples]) if spec.needs_advantages else None,  # type: ignore[misc]
        )
        loss, _ = compute_loss(spec, inputs)
        return float(loss)

    def optim_step(self, who: Principal, req: requests.OptimStep, digest: bytes) -> dict[str, Any]:
        row = self._run(who, req.model_id)
        with self._refusing(row, req.seq_id):
            step = req.adam()  # types and ranges refused now, before the request is queued

        def job() -> Reply:
            with self.residency.run(row) as manager:
                result = manager.optim_step(row.id, step)
            self.store.update_run(row.id, version=result.step)
            return json_reply({"type": "optim_step", "metrics": {
                "grad_norm:mean": result.grad_norm, "learning_rate:mean": result.lr, "step:max": float(result.step),
            }})

        return {"request_id": self._sequencer(row).submit(req.seq_id, self.guarded(job), digest), "model_id": row.id}

    # -- checkpoints ---------------------------------------------------------------------------

    def check_ttl(self, ttl: int | None) -> int | None:
        """`ttl` (seconds) when it is None or at least the server's minimum; InvalidInput otherwise."""
        if ttl is not None and ttl < self.bounds.min_ttl_s:
            raise InvalidInput("ttl_seconds", f"must be at least {self.bounds.min_ttl_s} seconds ([server] "
                               f"tinker_min_ttl_s), got {ttl}")
        return ttl

    def _checkpoint_target(self, row: RunRow, kind: str, name: str, overwrite: bool) -> Path:
        check_name(name, "path")
        existing = self.store.find_checkpoint(row.id, kind, name)
        if existing is not None and not overwrite:
            raise InvalidInput("path", f"a checkpoint tinker://{row.id}/{kind}/{name} exists; save under another "
                               "name or with overwrite=True")
        return self.layout.checkpoint(row.id, kind, name)

    def _record(self, row: RunRow, kind: str, name: str, directory: Path, ttl: int | None,
                user_metadata: dict[str, str] | None, version: int) -> Checkpoint:
        now = time.time()
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        ckpt = Checkpoint(row.id, kind, name, row.owner, row.base_model, row.base, now, size,
                          None if ttl is None else now + ttl, False, dict(user_metadata or {}),
                          {"lora": row.lora, "version": version})
        self.store.put_checkpoint(ckpt)
        return ckpt

    def save_weights(self, who: Principal, req: requests.SaveWeights, digest: bytes) -> dict[str, Any]:
        row = self._run(who, req.model_id)
        with self._refusing(row, req.seq_id):
            if req.path is None:
                raise InvalidInput("path", "give the checkpoint a name (save_state(name))")
            check_name(req.path, "path")
            self.check_ttl(req.ttl_seconds)

        def job() -> Reply:
            directory = self._checkpoint_target(row, "weights", req.path, req.overwrite)  # type: ignore[arg-type]
            with self.residency.run(row) as manager:
                manager.save_state(row.id, directory)
                version = manager.runs[row.id].version
            ckpt = self._record(row, "weights", req.path, directory, req.ttl_seconds, req.user_metadata, version)  # type: ignore[arg-type]
            return json_reply({"type": "save_weights", "path": ckpt.path})

        return {"request_id": self._sequencer(row).submit(req.seq_id, self.guarded(job), digest), "model_id": row.id}

    def save_weights_external(self, who: Principal, req: requests.SaveWeightsExternal, digest: bytes) -> dict[str, Any]:
        row = self._run(who, req.model_id)
        with self._refusing(row, req.seq_id):
            check_name(req.path, "path")
            self.check_ttl(req.ttl_seconds)
            if req.age_encryption_recipients:
                raise InvalidInput("age_encryption_recipients", "floe does not encrypt exports; the files stay on this "
                                   "server and download over your own connection")

        def job() -> Reply:
            directory = self._checkpoint_target(row, "external_weights", req.path, overwrite=False)
            with self.residency.run(row) as manager:
                version = manager.save_sampler_weights(row.id, directory)
            ckpt = self._record(row, "external_weights", req.path, directory, req.ttl_seconds, None, version)
            return json_reply({"type": "save_weights_external", "path": ckpt.path, "size_bytes": ckpt.size_bytes})

        return {"request_id": self._sequencer(row).submit(req.seq_id, self.guarded(job), digest), "model_id": row.id}

    def save_weights_for_sampler(self, who: Principal, req: requests.SaveWeightsForSampler, digest: bytes) -> dict[str, Any]:
        row = self._run(who, req.model_id)
        with self._refusing(row, req.seq_id):
            self.check_ttl(req.ttl_seconds)
            if req.path is not None:
                check_name(req.path, "path")
            elif req.sampling_session_seq_id is None:
                raise InvalidInput("path", "give a name (path) or a sampling_session_seq_id")

        def job() -> Reply:
            if req.path is not None:
                directory = self._checkpoint_target(row, "sampler_weights", req.path, overwrite=True)
                with self.residency.run(row) as manager:
                    version = manager.save_sampler_weights(row.id, directory)
                ckpt = self._record(row, "sampler_weights", req.path, directory, req.ttl_seconds, req.user_metadata, version)
                return json_reply({"type": "save_weights_for_sampler", "path": ckpt.path, "weights_version": version},
                                  {VERSION_HEADER: str(version)})
            sid = check_name(f"{row.session_id}:sample:{req.sampling_session_seq_id}", "sampling_session_seq_id")
            with self.residency.run(row) as manager:
                info = manager.snapshot(row.id)
            sampler = SamplerRow(sid, row.owner, row.session_id, row.base_model, row.base, row.id, None, info.version,
                                 req.kind, time.time())
            self.store.add_sampler(sampler)
            self.residency.added_snapshot(sampler, info)
            return json_reply({"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sid,
                               "weights_version": info.version}, {VERSION_HEADER: str(info.version)})

        return {"request_id": self._sequencer(row).submit(req.seq_id, self.guarded(job), digest), "model_id": row.id}

    def load_weights(self, who: Principal, req: requests.LoadWeights, digest: bytes) -> dict[str, Any]:
        if req.model_id is not None:  # into one of the caller's runs, in its sequence
            row = self._run(who, req.model_id)
            with self._refusing(row, req.seq_id):
                ckpt, directory = self._loadable(who, req)
                if ckpt.base != row.base:
                    raise InvalidInput("path", f"the checkpoint was trained on {ckpt.base_model!r}; this run is on "
                                       f"{row.base_model!r}")

            def job() -> Reply:
                with self.residency.run(row) as manager:
                    run = manager.reload(row.id, directory, req.optimizer)
                self.store.update_run(row.id, version=run.version)
                return json_reply({"type": "load_weights", "path": req.path, "model_id": row.id})

            return {"request_id": self._sequencer(row).submit(req.seq_id, self.guarded(job), digest), "model_id": row.id}

        # create-via-load: a new run of the caller's session, starting from the checkpoint
        ckpt, directory = self._loadable(who, req)
        if req.session_id is None or req.model_seq_id is None:
            raise InvalidInput("session_id", "give model_id, or session_id and model_seq_id (a new run)")
        base_model = req.base_model if req.base_model is not None else ckpt.base_model
        if self.base_key(base_model) != ckpt.base:
            raise InvalidInput("base_model", f"the checkpoint was trained on {ckpt.base_model!r}, not {base_model!r}")
        meta = (read_meta(directory) or {}).get("run") or {}
        # The saved run's user_metadata is its owner's (it may hold their project names or keys): a
        # run loaded from a checkpoint that another key published starts without it.
        inherited = (meta.get("user_metadata") or {}) if ckpt.owner == who.id else {}

        def create(row: RunRow) -> Reply:
            manager = self.residency.manager(row.base)
            run = manager.load_state(row.id, directory, req.optimizer)
            self.residency.added_run(row.id, row.base)
            self.store.update_run(row.id, version=run.version)
            return json_reply({"type": "load_weights", "path": req.path, "model_id": row.id})

        return self._new_run(who, req.session_id, req.model_seq_id, base_model, digest, meta.get("lora"),
                             req.user_metadata if req.user_metadata is not None else inherited, create)

    def _loadable(self, who: Principal, req: requests.LoadWeights) -> tuple[Checkpoint, Path]:
        """The training state `req.path` names, which `who` may load (its own or a published
        one), and its directory; InvalidInput (NotFound) otherwise."""
        if req.weights_access_token is not None:
            raise InvalidInput("weights_access_token", "floe has no cross-key access tokens: the checkpoint's owner "
                               "publishes it (tinker checkpoint publish), then any key may load it")
        if req.optimizer_config is not None and req.optimizer_config.type != "adamw":
            raise InvalidInput("optimizer_config.type", f"floe trains with adamw only, got {req.optimizer_config.type!r}")
        ckpt = self.store.checkpoint(req.path, who, kinds=("weights",))
        return ckpt, self.layout.checkpoint(ckpt.run_id, ckpt.kind, ckpt.name)

    # -- sampling ---------------------------------------------------------------------------

    def create_sampling_session(self, who: Principal, req: requests.CreateSamplingSession) -> dict[str, Any]:
        session = self._open_session(who, req.session_id)
        sid = check_name(f"{session.id}:sample:{req.sampling_session_seq_id}", "sampling_session_seq_id")
        if req.model_path is not None:
            ckpt = self.store.checkpoint(req.model_path, who, field="model_path")
            if ckpt.kind == "weights":
                raise InvalidInput("model_path", "sample from sampler weights (save_weights_for_sampler), not a training state")
            row = SamplerRow(sid, who.id, session.id, ckpt.base_model, ckpt.base, None, ckpt.path,
                             int(ckpt.info.get("version", 0)), "checkpoint", time.time())
        else:
            key = self.base_key(req.base_model)
            row = SamplerRow(sid, who.id, session.id, req.base_model, key, None, None, 0, "base", time.time())  # type: ignore[arg-type]
        self.store.add_sampler(row)
        try:
            with self.residency.sampler(row):  # loads now, so a checkpoint that does not load fails here
                pass
        except BaseException:
            self.store.remove_sampler(sid)
            raise
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def get_sampler(self, who: Principal, sampler_id: str) -> dict[str, Any]:
        row = self.store.sampler(sampler_id, who, field="sampler_id")
        self._check_source(who, row, field="sampler_id")
        out: dict[str, Any] = {"sampler_id": row.id, "base_model": row.base_model}
        if row.model_path:
            out["model_path"] = row.model_path
        return out

    def _sampler(self, who: Principal, sampler_id: Any) -> SamplerRow:
        row = self.store.sampler(sampler_id, who)
        self._open_session(who, row.session_id)
        self._check_source(who, row)
        return row

    def _check_source(self, who: Principal, row: SamplerRow, field: str = "sampling_session_id") -> None:
        """A sampler made from a checkpoint (`model_path`) is bound to that checkpoint record: it
        samples only while `who` may still load it, checked at every request and again when the
        work starts (and so before its weights are loaded back from disk). Once the checkpoint is
        deleted, replaced by a newer one of the same name (`created` after the sampler), expired,
        or (for another key) unpublished, the sampler is released and answers 404 like an unknown
        one. That holds for the owner's own sampler too: its weights are gone from disk."""
        if row.kind != "checkpoint" or row.model_path is None:
            return
        try:
            ckpt = self.store.checkpoint(row.model_path, who, field=field)
            current = ckpt.created <= row.created
        except NotFound:
            current = False
        if current:
            return
        self.store.remove_sampler(row.id)
        self.residency.drop_sampler(row)
        raise NotFound(field, f"no sampler {row.id!r} for this key: a sampler made from a checkpoint "
                       "ends when the checkpoint is deleted, replaced, expires or stops being published; create a "
                       "new sampling client from a checkpoint this key may load")

    def asample(self, who: Principal, body: dict[str, Any]) -> dict[str, Any]:
        num = convert.num_samples(body.get("num_samples", 1))
        if num > self.bounds.samples_per_request:
            raise InvalidInput("num_samples", f"must be at most {self.bounds.samples_per_request} ([server] "
                               f"tinker_max_samples_per_request), got {num}")
        row = self._sampler(who, body.get("sampling_session_id"))
        manager = self.bases[row.base]
        call = convert.sample_request(body, num, manager.vocab_size, manager.max_context)  # every field checked now
        params = call.params
        if num * params.max_tokens > self.bounds.sampled_tokens_per_request:
            raise InvalidInput("num_samples", f"num_samples x max_tokens = {num * params.max_tokens} exceeds "
                               f"{self.bounds.sampled_tokens_per_request} ([server] tinker_max_sampled_tokens_per_request)")
        if num > manager.max_batch_sequences:  # the engine's own check, made now instead of inside the future
            raise InvalidInput("num_samples", f"must be at most {manager.max_batch_sequences}: all samples of a prompt "
                               "decode in one batch of [sampler.engine] max_batch_sequences rows; got "
                               f"{num}: split the request")
        if call.record_stability and num * params.max_tokens > self.bounds.stability_tokens:
            raise InvalidInput("record_stability_info", f"num_samples x max_tokens = {num * params.max_tokens} exceeds "
                               f"the {self.bounds.stability_tokens} tokens of stability info this server records per key "
                               f"({STABILITY_SETTING}): sample fewer or shorter sequences per request")
        if call.topk_sample:
            params = replace(params, top_logprobs=call.topk_sample)
        if call.alt_k and params.seed is None:  # one seed for the samples and the alternative draws
            params = replace(params, seed=manager.draw_seed())
        self.futures.admit(who.id)  # 429 past the key's bound on queued work, before any work
        rid = self.futures.new(who.id)

        def job() -> Reply:
            self._check_source(who, row)  # still allowed now that its turn came (a revoke in between)
            with self.residency.sampler(row) as (held, info):
                group = held.sample(info, call.prompt, call.num_samples, params)
                if call.record_stability:  # before the reply: a client learns the ids from it
                    for i, s in enumerate(group.samples):
                        self.stability.put(who.id, row.session_id, f"{rid}:{i}", s.tokens, s.logprobs)
                prompt_lp = None
                if call.prompt_logprobs:
                    prompt_lp = convert.prompt_logprobs_row(held.prompt_logprobs(info, call.prompt), call.last_n)
                scores = None
                if call.scores_prompt_distribution:
                    scores = held.prompt_scores(
                        info, call.prompt, topk=call.topk_prompt,
                        target_ids=call.targets.ids if call.targets is not None else None,
                        alt_k=call.alt_k, temperature=params.temperature, seed=params.seed,
                    )
            return Reply(200, convert.sample_output(group, call, prompt_lp, scores), PROTO,
                         {VERSION_HEADER: str(info.version)})

        self.futures.run(rid, who.id, self.guarded(job))
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(num)]}

    # -- runs and checkpoints (REST) ----------------------------------------------------------

    def _checkpoint_json(self, ckpt: Checkpoint) -> dict[str, Any]:
        stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
        return {"checkpoint_id": f"{ckpt.kind}/{ckpt.name}", "checkpoint_type": _KIND_TYPES[ckpt.kind],
                "time": stamp(ckpt.created), "tinker_path": ckpt.path, "size_bytes": ckpt.size_bytes,
                "public": ckpt.public, "user_metadata": ckpt.user_metadata or None,
                "expires_at": None if ckpt.expires is None else stamp(ckpt.expires)}

    def training_run(self, who: Principal, run_id: str) -> dict[str, Any]:
        row = self.store.run(run_id, who, field="run_id")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row.last_request))
        last: dict[str, Any] = {}
        for kind, key in (("weights", "last_checkpoint"), ("sampler_weights", "last_sampler_checkpoint")):
            found = [c for c in self.store.checkpoints(who, row.id, 0, 1000)[0] if c.kind == kind]
            last[key] = self._checkpoint_json(found[0]) if found else None
        meta = {k: str(v) for k, v in row.user_metadata.items()}
        return {"training_run_id": row.id, "base_model": row.base_model, "model_owner": row.owner,
                **self._lora_fields(row), "corrupted": row.status == "lost", "last_request_time": stamp,
                **last, "user_metadata": meta}

    def training_runs(self, who: Principal, offset: int, limit: int) -> dict[str, Any]:
        rows, total = self.store.runs(who, offset, limit)
        return {"training_runs": [self.training_run(who, r.id) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def checkpoints(self, who: Principal, run_id: str | None, offset: int, limit: int) -> dict[str, Any]:
        if run_id is not None:
            self.store.run(run_id, who, field="run_id")
        rows, total = self.store.checkpoints(who, run_id, offset, limit)
        return {"checkpoints": [self._checkpoint_json(c) for c in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def weights_info(self, who: Principal, path: str) -> dict[str, Any]:
        ckpt = self.store.checkpoint(path, who, field="tinker_path")
        lora = ckpt.info.get("lora")
        out: dict[str, Any] = {"base_model": ckpt.base_model, "optimizer_config": {"type": "adamw"},
                               "is_lora": lora is not None}
        if lora is not None:
            out.update(lora_rank=int(lora["rank"]), train_unembed=bool(lora.get("train_unembed", True)),
                       train_mlp=bool(lora.get("train_mlp", True)), train_attn=bool(lora.get("train_attn", True)))
        return out

    def _owned_checkpoint(self, who: Principal, run_id: str, checkpoint_id: str) -> Checkpoint:
        kind, _, name = checkpoint_id.partition("/")
        return self.store.checkpoint(f"tinker://{run_id}/{kind}/{name}", who, field="checkpoint_id", change=True)

    def _delete_checkpoint_files(self, ckpt: Checkpoint) -> None:
        directory = self.layout.checkpoint(ckpt.run_id, ckpt.kind, ckpt.name)
        if directory.exists():
            aside = directory.parent / f".{directory.name}.deleted-{uuid.uuid4().hex[:8]}"
            directory.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)

    def delete_checkpoint(self, who: Principal, run_id: str, checkpoint_id: str) -> None:
        ckpt = self._owned_checkpoint(who, run_id, checkpoint_id)
        self._delete_checkpoint_files(ckpt)
        self.store.remove_checkpoint(ckpt)
        self._forget_unused()  # a closed run's last checkpoint: the run goes with it

    def publish(self, who: Principal, run_id: str, checkpoint_id: str, public: bool) -> None:
        ckpt = self._owned_checkpoint(who, run_id, checkpoint_id)
        if ckpt.kind == "external_weights":
            raise InvalidInput("checkpoint_id", "external weights are downloads, not checkpoints to share; publish the "
                               "training or sampler checkpoint")
        self.store.update_checkpoint(ckpt, public=public)

    def set_ttl(self, who: Principal, run_id: str, checkpoint_id: str, ttl: int | None) -> None:
        ckpt = self._owned_checkpoint(who, run_id, checkpoint_id)
        self.check_ttl(ttl)
        self.store.update_checkpoint(ckpt, expires=None if ttl is None else time.time() + ttl)

    def checkpoint_files(self, who: Principal, run_id: str, checkpoint_id: str) -> tuple[Checkpoint, list[str]]:
        """An external-weights checkpoint of `who` and its files (paths relative to its root)."""
        kind, _, name = checkpoint_id.partition("/")
        ckpt = self.store.checkpoint(f"tinker://{run_id}/{kind}/{name}", who, field="checkpoint_id",
                                     kinds=("external_weights",))
        directory = self.layout.checkpoint(ckpt.run_id, ckpt.kind, ckpt.name)
        return ckpt, sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


_KIND_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def requests_path(model_path: str) -> tuple[str, str, str]:
    from floe.server.protocols.tinker.store import parse_tinker_path  # noqa: PLC0415

    return parse_tinker_path(model_path, "model_path")


def _digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()
