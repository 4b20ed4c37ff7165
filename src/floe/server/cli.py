"""`floe serve CONFIG.toml [@ OVERLAY.toml ...] [--section.key VALUE ...] [--host] [--port] ...`

Files, overlays and overrides use the same syntax as `floe train` (floe.config). The merged
config is one of:
* a training recipe (it has a `[model]` table): validated as a Recipe, its model prepared
  exactly as `floe train` would (a tiny model is built and warm-started if the recipe says
  so), served with the recipe's `[backend]` settings;
* a file with a `[backend]` table: that table is the BackendConfig;
* otherwise the whole file is the BackendConfig.
An optional `[server]` table sets ServerConfig; command-line flags override it. Any other key
is an error, as everywhere in floe. The token may also come from the FLOE_TOKEN environment
variable (kept out of `ps`).

Start-up order: configs and flags are validated, then host:port is bound (a port in use is one
line, exit 2), and only then is the model prepared and loaded; uvicorn serves on that socket.
The placement is the config's (`[backend.placement]`, e.g. `@ recipes/overlays/ray.toml`): a Ray
backend is served exactly like a local one. `--resume-latest` loads the newest intact saved state
(by its state.json time; a state whose overwrite a crash interrupted is recovered first, and a
damaged one is skipped with a line saying which and why) before serving, so a server restarted
on a fresh cluster continues where the last one saved; on shutdown the backend is closed (a Ray placement's workers go).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from floe.config import BackendConfig, load_layers, parse_config, split_recipe_args
from floe.errors import FloeError, InvalidInput
from floe.server.auth import check_exposure
from floe.server.connections import guarded_protocol
from floe.server.settings import ServerConfig

if TYPE_CHECKING:
    from floe.rl.config import Recipe

log = logging.getLogger("floe.server")


def build_parser(prog: str = "floe serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a floe backend over HTTP (see docs/remote.md).")
    p.epilog = "CONFIG.toml [@ OVERLAY.toml ...] [--section.key VALUE ...] come first, as for `floe train`."
    p.add_argument("--host", help="address to listen on (default 127.0.0.1); non-loopback needs a token")
    p.add_argument("--port", type=int, help="port (default 7000; 0 = any free port)")
    p.add_argument("--token", help="bearer token clients must send (default: $FLOE_TOKEN)")
    p.add_argument("--max-request-mb", type=float, help="request body limit (default 256)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume-from", metavar="NAME", help="load this saved state before serving")
    resume.add_argument("--resume-latest", action="store_true", help="load the most recently saved state, if any")
    p.add_argument("--log-level", help="debug | info | warning | error (default info)")
    return p


def parse_serve_args(argv: list[str]) -> tuple[list[str], dict[str, Any], argparse.Namespace]:
    """(config files, dotted overrides, flags) from the command line."""
    files, overrides, rest = split_recipe_args(argv)
    args = build_parser().parse_args(rest)
    if not files:
        raise InvalidInput("CONFIG", "give a config or recipe TOML file")
    return files, overrides, args


def parse_backend(data: dict[str, Any]) -> BackendConfig | Recipe:
    """The backend a merged serve config describes (module docstring), validated but not yet
    prepared: a `floe.rl.config.Recipe` or a BackendConfig; both have ``state_dir``. Cheap: no
    model is built or checked here (`prepare_backend` does that). Raises InvalidInput."""
    if "model" in data and isinstance(data["model"], dict):
        from floe.rl.config import parse_recipe  # noqa: PLC0415 - only recipes need the RL package

        recipe = parse_recipe(data)
        if recipe.url is not None:
            raise InvalidInput("recipe.backend.url", "floe serve runs the backend itself; drop backend.url")
        return recipe
    if "backend" in data:
        extra = sorted(set(data) - {"backend"})
        if extra:
            raise InvalidInput(extra[0], "unknown table; a serve config has [backend] and [server] only")
        return parse_config(BackendConfig, data["backend"], "backend")
    return parse_config(BackendConfig, data, "backend")


def prepare_backend(parsed: BackendConfig | Recipe) -> BackendConfig:
    """The BackendConfig for `parse_backend`'s result: a recipe's checks run (device, model
    source, data rows) and its model is prepared exactly as `floe train` would; a BackendConfig
    is returned as it is. Raises InvalidInput."""
    if isinstance(parsed, BackendConfig):
        return parsed
    from floe.rl.preflight import check_recipe  # noqa: PLC0415 - only recipes need the RL package
    from floe.rl.warmstart import prepare_model  # noqa: PLC0415

    check_recipe(parsed)  # device, model source, data rows: before the model is built
    return parsed.backend_config(prepare_model(parsed))


def backend_from(data: dict[str, Any]) -> BackendConfig:
    """The BackendConfig a merged serve config describes (see the module docstring)."""
    return prepare_backend(parse_backend(data))


def server_from(data: dict[str, Any], args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig from the merged config's `[server]` table (removed from ``data``) and the
    flags, which win. Raises InvalidInput naming ``server.<key>``."""
    server_data: dict[str, Any] = data.pop("server", {}) if isinstance(data.get("server"), dict) else {}
    flags = {"host": args.host, "port": args.port, "token": args.token or os.environ.get("FLOE_TOKEN"),
             "max_request_mb": args.max_request_mb, "log_level": args.log_level}
    return parse_config(ServerConfig, {**server_data, **{k: v for k, v in flags.items() if v is not None}}, "server")


def load_serve_config(
    files: list[str], overrides: dict[str, Any], args: argparse.Namespace
) -> tuple[BackendConfig, ServerConfig]:
    """(backend config, server config) from files, overlays, overrides and flags."""
    data = _merge(files, overrides)
    server = server_from(data, args)
    return backend_from(data), server


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (port 0 = any free one), not yet listening;
    uvicorn listens and serves on it. SO_REUSEADDR is set, as uvicorn sets it (a port left in
    TIME_WAIT by a killed server binds again). Raises OSError (`listen_error` words it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def listen_error(host: str, port: int, error: OSError) -> str:
    """One line for why ``host``:``port`` cannot be bound, and the fix."""
    if error.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use; choose another with --port"
    if error.errno == errno.EACCES:
        return f"port {port} on {host} needs privileges this user lacks; choose another with --port (1024 or above)"
    reason = error.strerror or str(error)
    return f"cannot listen on {host} port {port}: {reason}; check --host (an address of this machine, e.g. 127.0.0.1)"


def _merge(files: list[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """The merged config; recipes (a [model] table in some layer) merge as `floe train` merges
    them, so a later `model.path` replaces an earlier `[model.tiny]`."""
    data = load_layers(files, overrides)
    if isinstance(data.get("model"), dict):
        from floe.rl.config import merge_recipe_layers  # noqa: PLC0415 - only recipes need the RL package

        return merge_recipe_layers(files, overrides)
    return data


def latest_state(state_dir: Path) -> str | None:
    """The most recently saved intact state under `state_dir` (by its state.json time), if any
    (`floe.backend.state.newest_intact_state`: interrupted overwrites recovered, damaged states
    skipped)."""
    from floe.backend.state import newest_intact_state  # noqa: PLC0415 - torch, once we will serve

    return newest_intact_state(Path(state_dir))[0]


def serve_main(argv: list[str]) -> int:
    try:
        files, overrides, args = parse_serve_args(argv)
        data = _merge(files, overrides)
        server_config = server_from(data, args)
        parsed = parse_backend(data)
        check_exposure(server_config.host, server_config.token, server_config.tinker_api_keys)
        if args.resume_from:
            from floe.backend.state import list_states  # noqa: PLC0415 - the one listing (interrupted swaps recovered)

            if args.resume_from not in list_states(Path(parsed.state_dir)):
                raise InvalidInput("--resume-from", f"no saved state {args.resume_from!r} in {parsed.state_dir}")
    except InvalidInput as e:
        print(f"floe serve: error: {e}", file=sys.stderr)
        return 2
    try:
        listener = bind_listener(server_config.host, server_config.port)  # before any model loads
    except OSError as e:
        print(f"floe serve: error: {listen_error(server_config.host, server_config.port, e)}", file=sys.stderr)
        return 2
    try:
        backend_config = prepare_backend(parsed)
    except InvalidInput as e:
        listener.close()
        print(f"floe serve: error: {e}", file=sys.stderr)
        return 2

    from floe.server.logs import configure_logging  # noqa: PLC0415 - heavy imports only once we will serve

    configure_logging(server_config.log_level)
    from floe.backend import Backend  # noqa: PLC0415
    from floe.server.app import create_app  # noqa: PLC0415

    try:
        backend = Backend(backend_config)
        resume = args.resume_from
        if args.resume_latest:
            from floe.backend.state import newest_intact_state  # noqa: PLC0415

            resume, skipped = newest_intact_state(Path(backend_config.state_dir))
            for name, why in skipped:
                log.warning("skipped a damaged state", extra={"state": name, "reason": why})
                print(f"floe serve: --resume-latest skipped the state {name!r}: {why}", file=sys.stderr)
        if resume:
            loaded = backend.load_state(resume)
            log.info("resumed", extra={"state": loaded.name, "step": loaded.step, "version": loaded.version})
        elif args.resume_latest:
            log.info("no saved state to resume; starting fresh", extra={"state_dir": backend_config.state_dir})
    except FloeError as e:
        listener.close()
        print(f"floe serve: error: {e}", file=sys.stderr)
        return 1
    app = create_app(backend, server_config)
    uv_config = uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=server_config.graceful_timeout_s,  # type: ignore[arg-type]
        http=guarded_protocol(server_config.max_connections, server_config.header_timeout_s),
    )
    server = DrainingServer(uv_config, on_exit=lambda: setattr(app.state.floe, "draining", True))
    try:
        server.run(sockets=[listener])
    finally:
        backend.close()  # engines, and a distributed placement's workers (and the cluster it started)
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: on SIGTERM/SIGINT the app answers 503 to new requests at once,
    while uvicorn stops accepting connections and lets in-flight requests finish."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                log.info("serving", extra={"host": host, "port": port, "pid": os.getpid()})
