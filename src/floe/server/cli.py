"""`floe serve CONFIG.toml [@OVERLAY.toml ...] [key=value ...] [--host] [--port] [--token] ...`

The config files are merged with floe.config.load_layers. The backend config is the file's
`[backend]` table when it has one (so a training recipe serves as is), otherwise the whole
file; an optional `[server]` table sets ServerConfig, and command-line flags override it.
The token may also come from the FLOE_TOKEN environment variable (kept out of `ps`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from floe.config import BackendConfig, load_layers, parse_config, parse_override_value
from floe.errors import FloeError, InvalidInput
from floe.server.auth import check_exposure
from floe.server.settings import ServerConfig

log = logging.getLogger("floe.server")


def build_parser(prog: str = "floe serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a floe backend over HTTP (see docs/remote.md).")
    p.add_argument("config", nargs="+", help="CONFIG.toml, then optional @OVERLAY.toml files and key=value overrides")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1); non-loopback needs a token")
    p.add_argument("--port", type=int, help="port (default 7000; 0 = any free port)")
    p.add_argument("--token", help="bearer token clients must send (default: $FLOE_TOKEN)")
    p.add_argument("--max-request-mb", type=float, help="request body limit (default 256)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume-from", metavar="NAME", help="load this saved state before serving")
    resume.add_argument("--resume-latest", action="store_true", help="load the most recently saved state, if any")
    p.add_argument("--log-level", help="debug | info | warning | error (default info)")
    return p


def load_serve_config(items: list[str], args: argparse.Namespace) -> tuple[BackendConfig, ServerConfig]:
    """(backend config, server config) from files, overlays, overrides and flags."""
    paths = [item.removeprefix("@") for item in items if "=" not in item]
    overrides = {k: parse_override_value(v) for k, _, v in (item.partition("=") for item in items if "=" in item)}
    data = load_layers(paths, overrides)
    server_data: dict[str, Any] = data.pop("server", {}) if isinstance(data.get("server"), dict) else {}
    backend_data = data["backend"] if isinstance(data.get("backend"), dict) else data
    backend = parse_config(BackendConfig, backend_data, "backend")
    flags = {"host": args.host, "port": args.port, "token": args.token or os.environ.get("FLOE_TOKEN"),
             "max_request_mb": args.max_request_mb, "log_level": args.log_level}
    server = parse_config(ServerConfig, {**server_data, **{k: v for k, v in flags.items() if v is not None}}, "server")
    return backend, server


def latest_state(state_dir: Path) -> str | None:
    """The most recently saved state under `state_dir` (by its state.json time), if any."""
    found = [p for p in state_dir.glob("*/state.json") if not p.parent.name.startswith(".")] if state_dir.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime_ns).parent.name if found else None


def serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        backend_config, server_config = load_serve_config(args.config, args)
        check_exposure(server_config.host, server_config.token)
        if args.resume_from and not (Path(backend_config.state_dir) / args.resume_from / "state.json").is_file():
            raise InvalidInput("--resume-from", f"no saved state {args.resume_from!r} in {backend_config.state_dir}")
    except InvalidInput as e:
        print(f"floe serve: {e}", file=sys.stderr)
        return 2

    from floe.server.logs import configure_logging  # noqa: PLC0415 - heavy imports only once we will serve

    configure_logging(server_config.log_level)
    from floe.backend import Backend  # noqa: PLC0415
    from floe.server.app import create_app  # noqa: PLC0415

    try:
        backend = Backend(backend_config)
        resume = args.resume_from or (latest_state(Path(backend_config.state_dir)) if args.resume_latest else None)
        if resume:
            loaded = backend.load_state(resume)
            log.info("resumed", extra={"state": loaded.name, "step": loaded.step, "version": loaded.version})
        elif args.resume_latest:
            log.info("no saved state to resume; starting fresh", extra={"state_dir": backend_config.state_dir})
    except FloeError as e:
        print(f"floe serve: {e}", file=sys.stderr)
        return 1
    app = create_app(backend, server_config)
    uv_config = uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=server_config.graceful_timeout_s,
    )
    server = DrainingServer(uv_config, on_exit=lambda: setattr(app.state.floe, "draining", True))
    server.run()
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
