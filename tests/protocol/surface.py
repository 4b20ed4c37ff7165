"""What every operation in OPS must have around it, checked against the real code: a Client
method with the same signature, an AsyncClient coroutine, a wire round trip of an example
request and result, a Backend method taking the same parameters, and a server route. Each
problem is reported as one sentence naming what is missing. Also: a real server on loopback
running in this process, so operations registered by a test are served."""

from __future__ import annotations

import dataclasses
import inspect
import socket
import threading
import time
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from floe.backend import Backend
from floe.client import AsyncClient, Client
from floe.protocol import wire
from floe.protocol.ops import Op
from floe.server.app import create_app
from floe.server.settings import ServerConfig


def example(hint: Any) -> Any:
    """A small value of type `hint` (the first member of a union, lists of one element,
    dataclasses filled field by field), used to round-trip an operation on the wire."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return example(next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        return args[0]
    if origin is list:
        return [example(args[0])]
    if origin is dict:
        return {"k": example(args[1])}
    if origin is tuple:
        return tuple(example(a) for a in args)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: example(hints[f.name]) for f in dataclasses.fields(hint) if f.init})
    simple = {int: 1, float: 0.5, str: "a", bool: True}
    if hint is Any:
        return 1
    if hint in simple:
        return simple[hint]
    raise TypeError(f"no example value for {hint!r}")


def _params(signature: inspect.Signature) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def check_client(op: Op) -> list[str]:
    method = getattr(Client, op.name, None)
    if not callable(method):
        return [f"Client has no method {op.name!r}"]
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    got = inspect.Signature(params, return_annotation=inspect.signature(method).return_annotation)
    problems = []
    if _params(got) != _params(op.signature):
        problems.append(f"Client.{op.name}{got} has other parameters than OPS[{op.name!r}]{op.signature}")
    hints = typing.get_type_hints(method)
    if hints != dict(op.hints):
        problems.append(f"Client.{op.name} annotations {hints} differ from OPS[{op.name!r}]: {dict(op.hints)}")
    return problems


def check_async_client(op: Op, client: AsyncClient) -> list[str]:
    method = getattr(client, op.name, None)
    if not inspect.iscoroutinefunction(method):
        return [f"AsyncClient has no coroutine {op.name!r}"]
    if _params(inspect.signature(method)) != _params(op.signature):
        return [f"AsyncClient.{op.name}{inspect.signature(method)} differs from OPS[{op.name!r}]{op.signature}"]
    return []


def check_wire(op: Op) -> list[str]:
    try:
        kwargs = {name: example(op.hints[name]) for name in op.parameters}
        result = example(op.hints["return"])
    except TypeError as e:
        return [f"the wire round trip of {op.name!r} has no example: {e}"]
    try:
        got_kwargs = wire.decode_request(op.name, wire.encode_request(op.name, kwargs))
        got_result = wire.decode_result(op.name, wire.encode_result(op.name, result))
    except Exception as e:  # noqa: BLE001 - reported as what is missing
        return [f"the wire cannot carry {op.name!r}: {type(e).__name__}: {e}"]
    problems = []
    if got_kwargs != kwargs:
        problems.append(f"the wire changes {op.name!r}'s arguments: {kwargs} came back as {got_kwargs}")
    if got_result != result:
        problems.append(f"the wire changes {op.name!r}'s result: {result} came back as {got_result}")
    return problems


def check_backend(op: Op, backend_cls: type = Backend) -> list[str]:
    method = getattr(backend_cls, op.name, None)
    if not callable(method):
        return [f"{backend_cls.__name__} has no method {op.name!r}"]
    params = [(p.name, p.kind, p.default) for p in list(inspect.signature(method).parameters.values())[1:]]
    if params != _params(op.signature):
        return [f"{backend_cls.__name__}.{op.name} parameters {params} differ from OPS[{op.name!r}]'s {_params(op.signature)}"]
    return []


def check_server(op: Op, url: str) -> list[str]:
    """An empty body must reach the operation (400: not a floe message), not 404 (no route)."""
    response = httpx.post(f"{url}/api/{op.name}", content=b"", timeout=30)
    if response.status_code != 400 or response.json().get("error") != "bad_request":
        return [f"the server has no route POST /api/{op.name} (answered {response.status_code}: {response.text[:200]})"]
    return []


def missing_surface(op: Op, url: str, client: AsyncClient, backend_cls: type = Backend) -> list[str]:
    """Every problem with `op`'s surroundings, one sentence each; [] when it is complete."""
    return [*check_client(op), *check_async_client(op, client), *check_wire(op), *check_backend(op, backend_cls),
            *check_server(op, url)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(backend: Backend) -> Iterator[str]:
    """The real floe app on loopback, served by uvicorn in a thread of this process (so it sees
    OPS as this process has it); yields the base URL."""
    port = free_port()
    app = create_app(backend, ServerConfig(port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)

