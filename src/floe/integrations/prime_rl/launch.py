"""`floe prime-rl @ rl.toml @ recipes/prime_rl/floe.toml [--a.b VALUE ...]`: one command for a
prime-rl recipe on floe, as prime-rl's own `rl @ rl.toml` is one command for its stack.

prime-rl's launcher (src/prime_rl/entrypoints/rl.py at PRIME_RL_COMMIT) reads the combined
config with `prime_rl.configs.rl.RLConfig`, writes each component's config with its
`write_subconfigs` and starts inference, one env server per source, the orchestrator and the
trainer. This command does the same with prime-rl's own classes and functions (RLConfig through
prime-rl's `cli`, `write_subconfigs`, `env_servers`, `validate_run_dir`, `clean_future_steps`,
`create_attempt_log_dir`), and replaces two of the four processes with floe's:

  inference     `floe serve` (started here on orchestrator.model.client.base_url's port, model =
                model.name, [backend.optimizer] = trainer.optim as `floe prime-trainer` checks it,
                [backend.lora] = trainer.model.lora (lora.server_lora), plus the overlay's
                [floe.backend] table), or the server at [floe] url
  trainer       `floe prime-trainer`'s `run`, in this process, on the same layers
  env servers   prime-rl's `env-server @ configs/envs/<split>/<name>.json`, unchanged
  orchestrator  prime-rl's `orchestrator @ configs/orchestrator.json`, unchanged

`[inference]` is what floe serve replaces: it is left out of the config prime-rl resolves (so
prime-rl's router-specific admin URL is not derived); its vLLM settings and `[deployment]`'s GPU
split become floe serve's placement and engine (hardware.prime_hardware), and what does not apply
on this machine is listed at start. `[floe]`
is floe's overlay table (config.FLOE_KEYS). Logs: <run dir>/logs/attempt_N/ (prime-rl's layout:
orchestrator.log, envs/<split>/<name>.log, trainer.log, plus floe_serve.log). A process that
exits early stops everything with an error naming it and its log; Ctrl-C and SIGTERM stop all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse

from floe.config import load_layers, parse_override_value
from floe.errors import FloeError, InvalidInput
from floe.integrations.hardware import describe, with_overrides
from floe.integrations.prime_rl.checkpoint import checkpoints_dir, read_checkpoint, resume_step
from floe.integrations.prime_rl.config import PrimeTrainerConfig, parse_config
from floe.integrations.prime_rl.formats import unpublish
from floe.integrations.prime_rl.hardware import PrimeHardware, prime_hardware
from floe.integrations.prime_rl.lora import server_lora

HOW_TO_GET_PRIME_RL = (
    "prime-rl is not importable in this Python ({python}): run `floe prime-rl` in prime-rl's environment with "
    "floe installed there (in a prime-rl checkout: `uv pip install -e <floe>[prime-rl]`, then `uv run floe prime-rl "
    "...`); floe pins prime-rl {commit}")
MAPPED_MODEL_KEYS = ("trainer.model.ac", "trainer.model.optimization_dtype")  # hardware.prime_hardware
STRIPPED = ("floe", "inference")  # tables prime-rl's RLConfig does not get (see the module doc)
STEP_LINE = re.compile(r"Step \d+")


def split_argv(argv: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """(`@ FILE` layers, `--key VALUE` / `--key=VALUE` flags in order) from the command line; a flag
    followed by another flag or nothing (prime-rl's bare `--resume`) has the value None."""
    files: list[str] = []
    flags: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@":
            if i + 1 >= len(argv):
                raise InvalidInput("@", "an '@' must be followed by a TOML file")
            files.append(argv[i + 1])
            i += 2
        elif arg.startswith("@"):
            files.append(arg[1:])
            i += 1
        elif arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if eq:
                flags.append((key, value))
            elif i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                flags.append((key, None))
            else:
                flags.append((key, argv[i + 1]))
                i += 1
            i += 1
        else:
            raise InvalidInput("arguments", f"unexpected {arg!r}; give @ FILE.toml layers and --section.key VALUE flags")
    if not files:
        raise InvalidInput("rl.toml", "give prime-rl's recipe, e.g. floe prime-rl @ examples/basic/reverse-text/rl.toml "
                           "@ recipes/prime_rl/floe.toml")
    return files, flags


def _stripped(key: str) -> bool:
    return key.split(".", 1)[0] in STRIPPED


def import_prime_rl() -> dict[str, Any]:
    """prime-rl's config class and launcher functions; InvalidInput saying how to get them."""
    try:
        # prime-rl's environment only (optional; not resolvable where floe is type-checked)
        from prime_rl.configs.rl import RLConfig  # type: ignore[import-not-found]  # noqa: PLC0415
        from prime_rl.entrypoints.rl import (  # type: ignore[import-not-found]  # noqa: PLC0415
            ENVS_DIR,
            ORCHESTRATOR_CONFIG,
            env_servers,
            write_subconfigs,
        )
        from prime_rl.utils.config import cli  # type: ignore[import-not-found]  # noqa: PLC0415
        from prime_rl.utils.pathing import (  # type: ignore[import-not-found]  # noqa: PLC0415
            clean_future_steps,
            create_attempt_log_dir,
            get_config_dir,
            validate_run_dir,
        )
        from prime_rl.utils.process import DEFAULT_COMMON_ENV_VARS  # type: ignore[import-not-found]  # noqa: PLC0415
    except ImportError as e:
        from floe.integrations.prime_rl import PRIME_RL_COMMIT  # noqa: PLC0415

        raise InvalidInput("prime-rl", HOW_TO_GET_PRIME_RL.format(python=sys.executable, commit=PRIME_RL_COMMIT)
                           + f" ({e})") from None
    return {"RLConfig": RLConfig, "cli": cli, "env_servers": env_servers, "write_subconfigs": write_subconfigs,
            "ENVS_DIR": ENVS_DIR, "ORCHESTRATOR_CONFIG": ORCHESTRATOR_CONFIG, "clean_future_steps": clean_future_steps,
            "create_attempt_log_dir": create_attempt_log_dir, "get_config_dir": get_config_dir,
            "validate_run_dir": validate_run_dir, "DEFAULT_COMMON_ENV_VARS": DEFAULT_COMMON_ENV_VARS}


def resolve_rl_config(prime: dict[str, Any], files: list[str], flags: list[tuple[str, str | None]]) -> Any:
    """prime-rl's RLConfig of the layers and flags, less [floe] and [inference], parsed by prime-rl's
    own `cli` (its `@` merge and `--a.b-c VALUE` flags), as `rl @ ...` would parse them."""
    with tempfile.TemporaryDirectory(prefix="floe-prime-rl-") as tmp:
        args: list[str] = []
        for n, path in enumerate(files):
            layer = {k: v for k, v in load_layers([path]).items() if k not in STRIPPED}
            out = Path(tmp) / f"layer_{n}.json"
            out.write_text(json.dumps(layer))
            args += ["@", str(out)]
        for key, value in flags:
            if not _stripped(key):
                args += [f"--{key}"] if value is None else [f"--{key}", value]
        return prime["cli"](prime["RLConfig"], args=args)


@dataclass
class Plan:
    """Everything the launch needs, checked before any process starts."""

    rl: Any  # prime_rl.configs.rl.RLConfig
    trainer: PrimeTrainerConfig
    floe: dict[str, Any]
    hardware: PrimeHardware  # [deployment]'s GPU split and [inference.vllm] as floe serve's [backend]


def plan(argv: list[str], prime: dict[str, Any]) -> Plan:
    """Parse and cross-check the combined config; InvalidInput naming the first bad key."""
    files, flags = split_argv(argv)
    overrides = {k.replace("-", "_"): True if v is None else parse_override_value(v) for k, v in flags}
    raw = load_layers(list[str | Path](files), overrides)
    trainer = parse_config(raw)  # floe prime-trainer's reading of the same layers
    floe = dict(raw.get("floe") or {})
    if "backend" in floe and not isinstance(floe["backend"], dict):
        raise InvalidInput("floe.backend", "must be a table of floe serve [backend] keys (docs/recipes.md)")
    # the GPU split and vLLM settings are floe serve's placement; a running server ([floe] url) keeps
    # its own, and the keys are still checked (before prime-rl resolves its config: that imports the tasksets)
    hardware = prime_hardware(raw, _cuda_gpus(), floe.get("backend", {}))
    rl = resolve_rl_config(prime, files, flags)
    if (rl.resume is None) != (trainer.resume is None):
        raise InvalidInput("resume", "prime-rl's config and floe's trainer disagree on resume: set it at the top "
                           "level ([resume] or --resume)")
    if rl.slurm is not None or rl.deployment.type != "single_node":
        raise InvalidInput("slurm" if rl.slurm is not None else "deployment.type",
                           "floe prime-rl launches on this machine (floe serve places the model: [floe.backend]); "
                           "remove it")
    if trainer.run_dir != rl.run_dir:
        raise InvalidInput("floe.run_dir", f"the trainer's run directory {trainer.run_dir} is not prime-rl's "
                           f"{rl.run_dir} (output_dir / run.name): remove [floe] run_dir")
    if trainer.max_steps != rl.trainer.max_steps or rl.orchestrator.max_steps != rl.trainer.max_steps:
        raise InvalidInput("max_steps", f"trainer {rl.trainer.max_steps}, orchestrator {rl.orchestrator.max_steps}, "
                           f"floe's trainer {trainer.max_steps}: set the shared max_steps")
    if "ranks" not in floe:  # prime-rl's orchestrator writes one rank file per training GPU
        trainer = replace(trainer, ranks=rl.orchestrator.num_train_workers)
    if trainer.ranks != rl.orchestrator.num_train_workers:
        raise InvalidInput("floe.ranks", f"is {trainer.ranks}; the orchestrator writes "
                           f"{rl.orchestrator.num_train_workers} rank files per step (orchestrator.num_train_workers)")
    if rl.orchestrator.model.name != rl.trainer.model.name:
        raise InvalidInput("orchestrator.model.name", f"{rl.orchestrator.model.name!r} differs from the trainer's "
                           f"{rl.trainer.model.name!r}: floe serve samples and trains one model; set model.name")
    if "url" not in floe:  # the floe serve started here takes them (a running server keeps its own)
        trainer = replace(trainer, ignored_trainer_keys=[k for k in trainer.ignored_trainer_keys
                                                         if k not in MAPPED_MODEL_KEYS])
    ready = floe.get("ready_timeout_s", 300)
    if isinstance(ready, bool) or not isinstance(ready, (int, float)) or ready <= 0:
        raise InvalidInput("floe.ready_timeout_s", f"must be a number of seconds > 0, got {ready!r}")
    return Plan(rl=rl, trainer=trainer, floe=floe, hardware=hardware)


def fork_state(step_dir: Path, state_dir: Path) -> None:
    """`resume.dir` names another run's checkpoint: copy its floe state (in that run's `floe_states/`,
    where `floe prime-rl` keeps it) into this run's `state_dir`, so the floe serve started here loads it."""
    name = read_checkpoint(step_dir).state
    source = Path(step_dir).resolve().parents[1] / "floe_states" / name
    target = state_dir / name
    if target.exists():
        return
    if not (source / "state.json").is_file():
        raise InvalidInput("resume.dir", f"the floe state {name!r} of {step_dir} is not at {source}; copy it into "
                           f"{state_dir}, or resume through the floe serve that holds it ([floe] url)")
    shutil.copytree(source, target)


def _cuda_gpus() -> int:
    import torch  # noqa: PLC0415 - loaded already in prime-rl's environment (the trainer runs here)

    return torch.cuda.device_count()


def serve_address(base_url: str) -> tuple[str, int]:
    """(host, port) floe serve binds for orchestrator.model.client.base_url `http://HOST:PORT/v1`."""
    url = urlparse(base_url)
    if url.scheme != "http" or url.hostname not in ("localhost", "127.0.0.1") or url.path.rstrip("/") != "/v1":
        raise InvalidInput("orchestrator.model.client.base_url", f"is {base_url!r}; floe prime-rl starts floe serve on "
                           "this machine at http://127.0.0.1:PORT/v1 (or set [floe] url to a running floe serve and "
                           "base_url to its /v1)")
    return "127.0.0.1", url.port or 80


@dataclass
class Child:
    """One supervised process: its name (in errors), the process and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path


class Launch:
    """The running processes of one `floe prime-rl` run; `stop()` ends all of them."""

    def __init__(self, p: Plan, prime: dict[str, Any], out: TextIO):
        self.p, self.prime, self.out = p, prime, out
        self.children: list[Child] = []
        self.server: Any = None
        self.trainer_error: BaseException | None = None
        self.trainer_done = threading.Event()

    def say(self, line: str) -> None:
        print(f"floe prime-rl: {line}", file=self.out, flush=True)

    def spawn(self, name: str, module: str, config: Path, log: Path, env: dict[str, str]) -> None:
        """Start prime-rl's entry point `module.main` as `<name> @ config` (its own session, so stop()
        ends the process group, the env server's agent subprocesses too)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-c", f"from {module} import main; main()", "@", str(config)],
                                    stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.children.append(Child(name, proc, log))
        self.say(f"started {name} (pid {proc.pid}), log {log}")

    def start(self) -> Path:
        """Write prime-rl's configs, start floe serve, the env servers, the orchestrator and the trainer.
        Returns the log directory."""
        rl, prime, floe = self.p.rl, self.prime, self.p.floe
        os.environ.setdefault("PRL_RUN_ID", uuid.uuid4().hex)  # as prime-rl's rl(): every child inherits them
        os.environ["PRL_RUN_NAME"] = rl.run.name
        ckpt_dir = rl.ckpt.output_dir if rl.ckpt else None
        trainer = self.p.trainer
        prime["validate_run_dir"](rl.run_dir, output_dir=rl.output_dir, resuming=trainer.resume is not None,
                                  clean=rl.clean, ckpt_output_dir=ckpt_dir)
        rl.run_dir.mkdir(parents=True, exist_ok=True)
        # as prime-rl's rl(): a fresh run wipes every step directory, a resumed one those past its step
        step = -1 if trainer.resume is None else resume_step(trainer.resume, checkpoints_dir(rl.run_dir, trainer.ckpt))
        prime["clean_future_steps"](rl.run_dir, step)
        if trainer.resume is not None:
            unpublish(rl.run_dir, step)  # the trainer re-publishes it after loading the step's state
        config_dir = prime["get_config_dir"](rl.run_dir)
        prime["write_subconfigs"](rl, config_dir)
        log_dir = prime["create_attempt_log_dir"](rl.run_dir)
        self.say(f"run directory {rl.run_dir}; prime-rl's configs in {config_dir}; logs in {log_dir}")
        if self.p.hardware.notes:
            self.say(f"accepted without effect here: {'; '.join(self.p.hardware.notes)}")
        if trainer.resume is not None:
            self.say(f"resuming from step {step}")

        client_cfg = rl.orchestrator.model.client
        if "url" in floe:
            url, token = self.p.trainer.url, os.environ.get(self.p.trainer.token_env)
            self.say(f"training through floe serve at {url}; it keeps the placement, engine and precision it was "
                     "started with ([deployment], [inference.vllm] and trainer.model.ac were checked, not applied)")
        else:
            from floe.integrations.verl.local_server import LocalServer  # noqa: PLC0415 - floe serve as a child

            _, port = serve_address(client_cfg.base_url[0] if isinstance(client_cfg.base_url, list)
                                    else client_cfg.base_url)
            state_dir = rl.run_dir / "floe_states"
            if trainer.resume is not None and trainer.resume.dir is not None:
                fork_state(trainer.resume.dir, state_dir)
            placed = with_overrides(self.p.hardware.backend, floe.get("backend", {}), "floe.backend")
            backend = {"model": rl.trainer.model.name, "state_dir": str(state_dir),
                       "optimizer": self.p.trainer.optim.serve_optimizer(), **server_lora(self.p.trainer.lora, placed)}
            self.say(describe(backend))
            serve_log = log_dir / "floe_serve.log"
            self.say(f"starting floe serve for {rl.trainer.model.name} on 127.0.0.1:{port}, log {serve_log}")
            self.server = LocalServer(backend, serve_log, float(floe.get("ready_timeout_s", 300)),
                                      server={"served_model_name": rl.orchestrator.model.name}, port=port)
            url, token = self.server.url, self.server.token

        env = {**os.environ, **prime["DEFAULT_COMMON_ENV_VARS"], **rl.env_vars, **rl.orchestrator.env_vars}
        if token:
            env[client_cfg.api_key_var] = token  # the orchestrator's key for floe serve
        for split, source, address in prime["env_servers"](rl):
            name = source.resolved_name
            self.spawn(f"{split} env server {name} ({address})", "prime_rl.entrypoints.env_server",
                       config_dir / prime["ENVS_DIR"] / split / f"{name}.json",
                       log_dir / prime["ENVS_DIR"] / split / f"{name}.log", env)
        self.spawn("orchestrator", "prime_rl.entrypoints.orchestrator", config_dir / prime["ORCHESTRATOR_CONFIG"],
                   log_dir / "orchestrator.log", env)
        self.start_trainer(url, token, log_dir / "trainer.log")
        return log_dir

    def start_trainer(self, url: str, token: str | None, log: Path) -> None:
        """floe prime-trainer's `run` in a thread of this process; its lines go to `log` and step lines here."""
        from dataclasses import replace  # noqa: PLC0415

        import floe  # noqa: PLC0415 - the client stack
        from floe.integrations.prime_rl.trainer import run  # noqa: PLC0415

        cfg = replace(self.p.trainer, url=url)
        log_file = open(log, "a")  # noqa: SIM115 - open for the thread's lifetime

        def trainer_log(line: str) -> None:
            log_file.write(line + "\n")
            log_file.flush()
            if " step " in line or "published" in line:
                self.say(line)

        def body() -> None:
            try:
                client = floe.connect(cfg.url, token=token)
                try:
                    run(cfg, client, log=trainer_log)
                finally:
                    client.close()
            except BaseException as e:  # noqa: BLE001 - reported by supervise()
                self.trainer_error = e
                log_file.write(f"trainer failed: {type(e).__name__}: {e}\n")
            finally:
                log_file.flush()
                self.trainer_done.set()

        self.trainer_log = log
        threading.Thread(target=body, name="floe-prime-trainer", daemon=True).start()

    def supervise(self, poll_s: float = 0.5) -> None:
        """Until the orchestrator exits 0 and the trainer has trained every step; FloeError naming the
        first process that fails (or exits early) and its log. Echoes the orchestrator's step lines."""
        orch = next(c for c in self.children if c.name == "orchestrator")
        seen = 0
        while True:
            seen = self.echo_steps(orch.log, seen)
            if self.trainer_done.is_set() and self.trainer_error is not None:
                raise FloeError(f"the trainer (floe prime-trainer) failed: {self.trainer_error}; see {self.trainer_log}")
            for c in self.children:
                rc = c.proc.poll()
                if rc is None or (c is orch and rc == 0):
                    continue
                raise FloeError(f"{c.name} exited with status {rc}; see {c.log}:\n{_tail(c.log)}")
            if self.server is not None and self.server.proc.poll() is not None:
                raise FloeError(f"floe serve exited with status {self.server.proc.returncode}; see "
                                f"{self.server.log_path}:\n{_tail(self.server.log_path)}")
            if orch.proc.poll() == 0 and self.trainer_done.is_set():
                self.echo_steps(orch.log, seen)
                return
            time.sleep(poll_s)

    def echo_steps(self, log: Path, seen: int) -> int:
        """Print the orchestrator log's new step lines; returns how many bytes were read."""
        try:
            with open(log, "rb") as f:
                f.seek(seen)
                chunk = f.read()
        except OSError:
            return seen
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].decode(errors="replace").splitlines():
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            if STEP_LINE.search(line):
                self.say(f"orchestrator: {line.strip()}")
        return seen + end

    def stop(self, timeout_s: float = 15) -> None:
        """SIGTERM every child's process group, SIGKILL what is left after timeout_s; then floe serve."""
        for c in self.children:
            if c.proc.poll() is None:
                _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(c.proc, signal.SIGKILL)  # also what the group left behind
            c.proc.wait()
        if self.server is not None:
            self.server.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops all children as Ctrl-C does


def main(argv: list[str]) -> int:
    """`floe prime-rl @ rl.toml @ floe.toml [--a.b VALUE ...]`; returns the exit status."""
    if any(a in ("-h", "--help") for a in argv):
        print((__doc__ or "").strip() + "\n\nusage: floe prime-rl @ rl.toml @ recipes/prime_rl/floe.toml [--section.key VALUE ...]"
              "\nsee docs/integrations.md (prime-rl)")
        return 0
    prime = import_prime_rl()
    p = plan(argv, prime)
    launch = Launch(p, prime, sys.stdout)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    try:
        log_dir = launch.start()
        launch.supervise()
        launch.say(f"done: {p.trainer.max_steps} steps; logs in {log_dir}")
    finally:
        launch.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
