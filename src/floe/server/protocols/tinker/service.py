"""The Tinker protocol's state and operations: sessions, training runs, samplers, futures.

`TinkerService` turns decoded requests into work on `floe.backend.runs.RunManager` and replies
in the shapes the tinker 0.38 SDK validates. Ids follow the SDK's own scheme: a training run
is `<session>:train:<model_seq_id>` (the SDK derives it itself when it creates a run by
loading a checkpoint), a sampler `<session>:sample:<sampling_session_seq_id>`. Checkpoints are
`tinker://<run id>/weights/<name>` (weights + AdamW state) and
`tinker://<run id>/sampler_weights/<name>` (a peft adapter directory), stored under
`<backend state_dir>/tinker/<run id>/`.

With `[server] tinker_full_finetune = true`, `create_model` makes full fine-tune runs (every
weight of the run's own model copy trains; `floe.backend.runs`): the SDK always sends a
`lora_config`, whose rank and seed then do not apply and whose module switches must stay on;
`get_info` reports `is_lora: false`. One full run at a time.

A failed operation is answered through its future as `{"error", "category": "user"}`
(bad input, wrong state) or `"server"` (anything else), which the SDK raises as
`RequestFailedError` without retrying.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from floe.backend.runs import AdamStep, Run, RunManager, SamplerInfo
from floe.backend.state import check_state_name, delete_state_dir, read_meta
from floe.compute.losses import TokenInputs, compute_loss, resolve_loss
from floe.errors import FloeError, InvalidInput, StateError
from floe.models.lora import LoraSpec
from floe.server.protocols.tinker import convert, schema
from floe.server.protocols.tinker.futures import Futures, Reply, Sequencer

log = logging.getLogger("floe.server.tinker")

JSON = "application/json"
PROTO = "application/x-protobuf"
VERSION_HEADER = "X-Floe-Weights-Version"


def json_reply(payload: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
    return Reply(200, json.dumps(payload).encode(), JSON, headers or {})


def failure(exc: BaseException) -> Reply:
    """A failed operation, as the SDK expects it from retrieve_future."""
    if isinstance(exc, (InvalidInput, StateError, FloeError)):
        return json_reply({"error": str(exc), "category": "user"})
    log.exception("tinker operation failed", exc_info=exc)
    return json_reply({"error": f"{type(exc).__name__}: {exc}", "category": "server"})


def guarded(job: Callable[[], Reply]) -> Callable[[], Reply]:
    def run() -> Reply:
        try:
            return job()
        except BaseException as exc:  # noqa: BLE001 - every failure is answered through the future
            return failure(exc)

    return run


@dataclass
class Session:
    session_id: str
    tags: list[str]
    user_metadata: dict[str, Any]
    last_heartbeat: float = field(default_factory=time.time)
    finished: bool = False


@dataclass
class Sampler:
    sampler_id: str
    info: SamplerInfo
    model_path: str | None


class TinkerService:
    """Everything behind the /api/v1 routes (see the module docstring)."""

    def __init__(self, runs: RunManager, base_model: str, served_name: str, tokenizer_id: str, gap_timeout_s: float):
        self.runs = runs
        self.base_model = base_model
        self.served_name = served_name
        self.tokenizer_id = tokenizer_id
        self.futures = Futures()
        self.gap_timeout_s = gap_timeout_s
        self.sessions: dict[str, Session] = {}
        self.sequencers: dict[str, Sequencer] = {}
        self.samplers: dict[str, Sampler] = {}
        self.created: dict[str, float] = {}

    # -- names ------------------------------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        return list(dict.fromkeys([self.served_name, self.base_model]))

    def check_base_model(self, name: Any, field_name: str = "base_model") -> None:
        if name not in self.model_names:
            raise InvalidInput(field_name, f"this server serves {self.model_names}; got {name!r}")

    def checkpoint_dir(self, path: Any, kind: str | None = None, field_name: str = "path") -> tuple[str, str, Path]:
        """(run id, kind, directory) of a `tinker://<run>/<kind>/<name>` path."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise InvalidInput(field_name, f"must be a tinker://<run>/weights/<name> path, got {path!r}")
        parts = path.removeprefix("tinker://").split("/")
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[0]:
            raise InvalidInput(field_name, f"must be tinker://<run>/weights/<name> or .../sampler_weights/<name>, got {path!r}")
        run_id, found, name = parts
        if kind is not None and found != kind:
            raise InvalidInput(field_name, f"expected a {kind} checkpoint, got {path!r}")
        check_state_name(name)
        if ".." in run_id or "/" in run_id or run_id.startswith("."):
            raise InvalidInput(field_name, f"bad run id in {path!r}")
        return run_id, found, self.runs.root / run_id / found / name

    def _path(self, run_id: str, kind: str, name: str) -> tuple[str, Path]:
        try:
            check_state_name(name)
        except InvalidInput as exc:
            raise InvalidInput("path", exc.message) from None
        return f"tinker://{run_id}/{kind}/{name}", self.runs.root / run_id / kind / name

    # -- sessions ---------------------------------------------------------------------------

    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = uuid.uuid4().hex[:16]
        self.sessions[sid] = Session(sid, list(body.get("tags") or []), dict(body.get("user_metadata") or {}))
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, session_id: Any) -> bool:
        """False when the session finished (the SDK then stops its heartbeat)."""
        session = self.sessions.get(session_id)
        if session is None:
            return True
        session.last_heartbeat = time.time()
        return not session.finished

    def finish(self, session_id: str) -> None:
        """The session's runs and samplers are freed (their checkpoints stay on disk)."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.finished = True
        prefix = f"{session_id}:"
        for sid in [s for s in self.samplers if s.startswith(prefix)]:
            self.runs.release_sampler(self.samplers.pop(sid).info)
        for model_id in [m for m in self.sequencers if m.startswith(prefix)]:
            self.sequencers.pop(model_id)
            self.runs.close_run(model_id)

    # -- training runs ----------------------------------------------------------------------

    def _sequencer(self, model_id: Any) -> Sequencer:
        seq = self.sequencers.get(model_id) if isinstance(model_id, str) else None
        if seq is None:
            raise InvalidInput("model_id", f"no training run {model_id!r} on this server")
        return seq

    def _new_run(self, body: dict[str, Any], job: Callable[[str], Reply]) -> dict[str, Any]:
        session_id, seq = body.get("session_id"), body.get("model_seq_id")
        if not isinstance(session_id, str) or type(seq) is not int:
            raise InvalidInput("session_id", "session_id (string) and model_seq_id (integer) are required")
        model_id = f"{session_id}:train:{seq}"
        existing = self.sequencers.get(model_id)
        if existing is not None and existing.seen.get(0) is not None:
            return {"request_id": existing.seen[0], "model_id": model_id}  # a retried create
        sequencer = Sequencer(self.futures, self.gap_timeout_s)
        self.sequencers[model_id] = sequencer
        self.created[model_id] = time.time()
        rid = sequencer.submit(None, guarded(lambda: job(model_id)))
        sequencer.seen[0] = rid
        return {"request_id": rid, "model_id": model_id}

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        def job(model_id: str) -> Reply:
            self.check_base_model(body.get("base_model"))
            optimizer_config = body.get("optimizer_config") or {"type": "adamw"}
            optimizer = optimizer_config.get("type") if isinstance(optimizer_config, dict) else optimizer_config
            if optimizer != "adamw":
                raise InvalidInput("optimizer_config.type", f"floe trains with adamw only, got {optimizer!r}")
            spec = convert.lora_spec(body.get("lora_config"))  # types checked: "no" is not false
            if self.runs.full_finetune:
                self._check_full_finetune(spec)
                self.runs.create_run(model_id, None, body.get("user_metadata"))
                return json_reply({"type": "create_model", "model_id": model_id})
            self.runs.create_run(model_id, spec, body.get("user_metadata"))
            return json_reply({"type": "create_model", "model_id": model_id})

        return self._new_run(body, job)

    @staticmethod
    def _check_full_finetune(spec: LoraSpec) -> None:
        """The SDK always sends a lora_config; under `tinker_full_finetune` its rank and seed do
        not apply (every weight trains, none is initialised), and switching a module family off
        is refused (a full run trains them all)."""
        for key in ("train_attn", "train_mlp", "train_unembed"):
            if getattr(spec, key) is not True:
                raise InvalidInput(f"lora_config.{key}", "this server trains full fine-tune runs ([server] "
                                   "tinker_full_finetune = true), which train every weight; leave it true")

    @staticmethod
    def _lora_fields(run: Run) -> dict[str, Any]:
        """is_lora / lora_rank of a run as the SDK's responses carry them."""
        return {"is_lora": False} if run.spec is None else {"is_lora": True, "lora_rank": run.spec.rank}

    def get_info(self, model_id: Any) -> dict[str, Any] | None:
        run = self.runs.runs.get(model_id) if isinstance(model_id, str) else None
        if run is None:
            return None
        return {
            "type": "get_info", "model_id": model_id, **self._lora_fields(run),
            "model_name": self.base_model, "optimizer_config": {"type": "adamw"},
            "model_data": {"model_name": self.base_model, "tokenizer_id": self.tokenizer_id, "arch": "causal_lm"},
        }

    def forward_backward(self, body: bytes) -> dict[str, Any]:
        request = schema.ForwardBackwardRequest()
        try:
            request.ParseFromString(body)
        except Exception as exc:  # noqa: BLE001 - any decode failure is the client's bad body
            raise InvalidInput("body", f"not a ForwardBackwardRequest protobuf: {exc}") from None
        sequencer = self._sequencer(request.model_id)
        model_id, forward_only = request.model_id, request.forward_only

        def job() -> Reply:
            call = convert.forward_request_to_floe(request)
            if forward_only:
                logprobs, loss = self._forward_loss(model_id, call)
                metrics = {"loss:sum": loss}
            else:
                result = self.runs.forward_backward(model_id, call.batch, call.loss, call.loss_config)
                logprobs = [g[0] for g in result.logprobs]
                metrics = {"loss:sum": result.metrics["loss"]}
            return Reply(200, convert.forward_output(logprobs, metrics), PROTO)

        rid = sequencer.submit(request.seq_id or None, guarded(job))
        return {"request_id": rid, "model_id": model_id}

    def _forward_loss(self, model_id: str, call: convert.FloeCall) -> tuple[list[list[float]], float]:
        """Log-probs and the summed loss without gradients (floe's loss on the scored values)."""
        import torch  # noqa: PLC0415 - only forward-only requests need it here

        result = self.runs.forward(model_id, call.batch)
        logprobs = [g[0] for g in result.logprobs]
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
        return logprobs, float(loss)

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        sequencer = self._sequencer(body.get("model_id"))
        model_id = body["model_id"]
        raw = body.get("adam_params")

        def job() -> Reply:
            if raw is None:
                raise InvalidInput("adam_params", "floe trains with AdamW: send adam_params (AdamParams; "
                                   f"optimizer_params {body.get('optimizer_params')!r} are not served)")
            step = AdamStep.from_json(raw)  # finite, in range; a refused step changes nothing
            result = self.runs.optim_step(model_id, step)
            return json_reply({"type": "optim_step", "metrics": {
                "grad_norm:mean": result.grad_norm, "learning_rate:mean": result.lr, "step:max": float(result.step),
            }})

        return {"request_id": sequencer.submit(body.get("seq_id"), guarded(job)), "model_id": model_id}

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        sequencer = self._sequencer(body.get("model_id"))
        model_id = body["model_id"]

        def job() -> Reply:
            name = body.get("path") or f"step_{self.runs._run(model_id).version:06d}"
            path, directory = self._path(model_id, "weights", name)
            if body.get("path") and body.get("overwrite") is not True and read_meta(directory) is not None:
                raise InvalidInput("path", f"a checkpoint {path} exists; save under another name or with overwrite=True")
            self.runs.save_state(model_id, directory)
            return json_reply({"type": "save_weights", "path": path})

        return {"request_id": sequencer.submit(body.get("seq_id"), guarded(job)), "model_id": model_id}

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        sequencer = self._sequencer(body.get("model_id"))
        model_id = body["model_id"]
        session_id = model_id.split(":train:")[0]

        def job() -> Reply:
            name, seq = body.get("path"), body.get("sampling_session_seq_id")
            if name:
                path, directory = self._path(model_id, "sampler_weights", name)
                version = self.runs.save_sampler_weights(model_id, directory)
                return json_reply({"type": "save_weights_for_sampler", "path": path, "weights_version": version},
                                  {VERSION_HEADER: str(version)})
            if type(seq) is not int:
                raise InvalidInput("path", "give a name (path) or a sampling_session_seq_id")
            info = self.runs.snapshot(model_id)
            sid = f"{session_id}:sample:{seq}"
            self.samplers[sid] = Sampler(sid, info, None)
            return json_reply({"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sid,
                               "weights_version": info.version}, {VERSION_HEADER: str(info.version)})

        return {"request_id": sequencer.submit(body.get("seq_id"), guarded(job)), "model_id": model_id}

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        with_optimizer = bool(body.get("optimizer", False))
        if body.get("model_id") is None:  # create-via-load
            def create(model_id: str) -> Reply:
                if body.get("base_model") is not None:
                    self.check_base_model(body["base_model"])
                _, _, directory = self.checkpoint_dir(body.get("path"), "weights")
                self.runs.load_state(model_id, directory, with_optimizer)
                return json_reply({"type": "load_weights", "path": body.get("path"), "model_id": model_id})

            return self._new_run(body, create)
        sequencer = self._sequencer(body.get("model_id"))
        model_id = body["model_id"]

        def job() -> Reply:
            _, _, directory = self.checkpoint_dir(body.get("path"), "weights")
            self.runs.reload(model_id, directory, with_optimizer)
            return json_reply({"type": "load_weights", "path": body.get("path"), "model_id": model_id})

        return {"request_id": sequencer.submit(body.get("seq_id"), guarded(job)), "model_id": model_id}

    # -- sampling ---------------------------------------------------------------------------

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id, seq = body.get("session_id"), body.get("sampling_session_seq_id")
        if not isinstance(session_id, str) or type(seq) is not int:
            raise InvalidInput("session_id", "session_id (string) and sampling_session_seq_id (integer) are required")
        sid = f"{session_id}:sample:{seq}"
        model_path = body.get("model_path")
        if model_path is not None:
            _, kind, directory = self.checkpoint_dir(model_path, field_name="model_path")
            if kind == "weights":
                raise InvalidInput("model_path", "sample from sampler weights (save_weights_for_sampler), not a training state")
            info = self.runs.load_sampler(directory)
        else:
            self.check_base_model(body.get("base_model"))
            info = self.runs.base_sampler()
        self.samplers[sid] = Sampler(sid, info, model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def get_sampler(self, sampler_id: str) -> dict[str, Any] | None:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            return None
        out: dict[str, Any] = {"sampler_id": sampler_id, "base_model": self.base_model}
        if sampler.model_path:
            out["model_path"] = sampler.model_path
        return out

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = body.get("sampling_session_id")
        num = convert.num_samples(body.get("num_samples", 1))
        rid = self.futures.new()

        def job() -> Reply:
            sampler = self.samplers.get(sid)  # type: ignore[arg-type]
            if sampler is None:
                raise InvalidInput("sampling_session_id", f"no sampling session {sid!r} on this server")
            call = convert.sample_request(body, num, self.runs.vocab_size, self.runs.max_context)
            params = call.params
            if call.topk_sample:
                params = dataclasses.replace(params, top_logprobs=call.topk_sample)
            if call.alt_k and params.seed is None:  # one seed for the samples and the alternative draws
                params = dataclasses.replace(params, seed=self.runs.draw_seed())
            group = self.runs.sample(sampler.info, call.prompt, call.num_samples, params)
            prompt_lp = None
            if call.prompt_logprobs:
                prompt_lp = convert.prompt_logprobs_row(self.runs.prompt_logprobs(sampler.info, call.prompt), call.last_n)
            scores = None
            if call.scores_prompt_distribution:
                scores = self.runs.prompt_scores(
                    sampler.info, call.prompt, topk=call.topk_prompt,
                    target_ids=call.targets.ids if call.targets is not None else None,
                    alt_k=call.alt_k, temperature=params.temperature, seed=params.seed,
                )
            return Reply(200, convert.sample_output(group, call, prompt_lp, scores), PROTO,
                         {VERSION_HEADER: str(sampler.info.version)})

        self.futures.run(rid, guarded(job))
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(num)]}

    # -- runs and checkpoints (REST) ----------------------------------------------------------

    def training_run(self, run_id: str) -> dict[str, Any] | None:
        run = self.runs.runs.get(run_id)
        if run is None:
            return None
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created.get(run_id, time.time())))
        meta = {k: str(v) for k, v in run.user_metadata.items()}
        return {"training_run_id": run_id, "base_model": self.base_model, "model_owner": "local",
                **self._lora_fields(run), "last_request_time": stamp, "user_metadata": meta}

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> bool:
        kind, _, name = checkpoint_id.partition("/")
        _, _, directory = self.checkpoint_dir(f"tinker://{run_id}/{kind}/{name}", field_name="checkpoint_id")
        if not directory.exists():
            return False
        delete_state_dir(directory)
        return True

