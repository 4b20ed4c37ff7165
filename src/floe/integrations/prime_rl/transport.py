"""How `floe prime-trainer` receives prime-rl's rollouts: the two transports of prime-rl's
`rollout_transport` (pinned to `PRIME_RL_COMMIT`), behind one interface.

* `filesystem`: the orchestrator writes `<run_dir>/rollouts/step_{N}/rank_{R}.bin` (formats.py);
  the receiver waits for every rank's file of the step and reads it.
* `zmq` (prime-rl's default): the orchestrator binds a PUB socket at `tcp://host:port` and a PULL
  socket at `tcp://host:port+1`. Each trainer rank connects a SUB socket subscribed to the topic
  `data_rank|{R}|`, then pushes its rank (`b"{R}"`) to the PULL socket; the orchestrator sends
  nothing before every rank has announced itself (its READY barrier). Each step is then one
  two-frame message per rank, `[topic, msgpack list[MicroBatch]]`, in step order; messages carry
  no step number, so steps are counted from the first one received. floe's trainer is every rank
  at once: it subscribes to and announces all `ranks`, and announces them only once its SUB socket
  has connected, so READY cannot overtake the subscription. It connects only once both ports
  accept connections (`wait_listening`): zmq retries a connect to a port nobody listens on every
  100 ms, each try from a new ephemeral port, and when the port lies in the kernel's ephemeral
  range one try can be given that very port and connect to itself (TCP self-connect), which holds
  the port and the orchestrator's bind then fails with "Address already in use".

Both give `receive(step) -> list[MicroBatch]` (every rank's micro-batches of that step, rank 0
first) and raise StateError naming what did not arrive within `wait_timeout_s`.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from floe.errors import InvalidInput, StateError
from floe.integrations.prime_rl.formats import MicroBatch, decode_micro_batches, read_micro_batches, rollout_path


class FileSystemTransport(BaseModel):
    """`[rollout_transport] type = "filesystem"`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["filesystem"] = "filesystem"


class ZmqTransport(BaseModel):
    """`[rollout_transport] type = "zmq"`, with prime-rl's defaults (ZMQTransportConfig)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["zmq"] = "zmq"
    host: str = "localhost"
    port: int = Field(5555, ge=1, le=65534)  # port + 1 is the READY socket
    hwm: int = Field(10, ge=1)  # high-water mark: in-flight messages per socket


RolloutTransport = Annotated[FileSystemTransport | ZmqTransport, Field(discriminator="type")]


class RolloutReceiver(Protocol):
    def receive(self, step: int) -> list[MicroBatch]:
        """Every rank's micro-batches of `step` (rank 0 first); StateError on timeout."""
        ...

    def close(self) -> None: ...


@dataclass
class FileSystemReceiver:
    """Waits for `rollouts/step_{step}/rank_{r}.bin` of every rank, polling every `poll_s`."""

    run_dir: Path
    ranks: int
    poll_s: float
    wait_timeout_s: float | None

    def receive(self, step: int) -> list[MicroBatch]:
        paths = [rollout_path(self.run_dir, step, r) for r in range(self.ranks)]
        start = time.monotonic()
        while missing := [p for p in paths if not p.exists()]:
            if self.wait_timeout_s is not None and time.monotonic() - start > self.wait_timeout_s:
                raise StateError(f"waited {self.wait_timeout_s:g} s for {missing[0]}; is the orchestrator running with "
                                 f"output_dir/run.name pointing at {self.run_dir}?")
            time.sleep(self.poll_s)
        return [mb for p in paths for mb in read_micro_batches(p)]

    def close(self) -> None:
        pass


class ZmqReceiver:
    """prime-rl's ZMQ rollout protocol (module doc) for all `ranks` in one process (pyzmq)."""

    TOPIC = b"data_rank|"

    def __init__(self, transport: ZmqTransport, ranks: int, wait_timeout_s: float | None):
        try:
            import zmq  # noqa: PLC0415 - only this transport needs pyzmq
        except ImportError:
            raise InvalidInput("rollout_transport.type", "is \"zmq\", which needs pyzmq: pip install 'floe-rl[prime-rl]' "
                               "(prime-rl's own environment has it), or set type = \"filesystem\"") from None
        self._zmq = zmq
        self.ranks, self.wait_timeout_s = ranks, wait_timeout_s
        self.endpoint = f"tcp://{transport.host}:{transport.port}"
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, transport.hwm)
        # READY must not overtake the subscription (a slow joiner loses the first steps: PUB drops
        # what no subscriber asked for), so READY goes out once the SUB connection is up (announce()).
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        for rank in range(ranks):
            self._sub.setsockopt(zmq.SUBSCRIBE, self._topic(rank))
        self._ready = self._context.socket(zmq.PUSH)
        self._ready.setsockopt(zmq.SNDHWM, transport.hwm)
        self._transport = transport
        self._announced = False
        self._pending: dict[int, list[list[MicroBatch]]] = {r: [] for r in range(ranks)}

    def _announce(self, deadline: float | None) -> None:
        """Wait for the orchestrator's two sockets to listen, connect to them, wait for the SUB socket's
        handshake with the PUB, then push every rank's READY."""
        host, port = self._transport.host, self._transport.port
        for p in (port, port + 1):
            if not wait_listening(host, p, deadline):
                raise StateError(f"waited {self.wait_timeout_s:g} s for the orchestrator to listen on tcp://{host}:{p} "
                                 "(its rollout sockets); is it running with the same rollout_transport?")
        self._sub.connect(self.endpoint)
        self._ready.connect(f"tcp://{host}:{port + 1}")
        while not self._monitor.poll(1000 if deadline is None else max(1, int((deadline - time.monotonic()) * 1000))):
            if deadline is not None and time.monotonic() >= deadline:
                raise StateError(f"waited {self.wait_timeout_s:g} s to connect to the orchestrator's rollout "
                                 f"socket {self.endpoint}; is it running with the same rollout_transport?")
        self._monitor.recv_multipart()
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        for rank in range(self.ranks):
            self._ready.send(str(rank).encode())
        self._announced = True

    def _topic(self, rank: int) -> bytes:
        return self.TOPIC + str(rank).encode() + b"|"

    def receive(self, step: int) -> list[MicroBatch]:
        start = time.monotonic()
        if not self._announced:
            self._announce(None if self.wait_timeout_s is None else start + self.wait_timeout_s)
        while missing := [r for r in range(self.ranks) if not self._pending[r]]:
            left = None if self.wait_timeout_s is None else self.wait_timeout_s - (time.monotonic() - start)
            if left is not None and left <= 0:
                raise StateError(f"waited {self.wait_timeout_s:g} s for step {step}'s rollouts of rank {missing[0]} "
                                 f"on {self.endpoint}; is the orchestrator running with the same rollout_transport?")
            if not self._sub.poll(None if left is None else max(1, int(left * 1000))):
                continue
            topic, payload = self._sub.recv_multipart()
            rank = self._rank_of(topic)
            self._pending[rank].append(decode_micro_batches(payload, where=f"{self.endpoint} {topic!r}"))
        return [mb for r in range(self.ranks) for mb in self._pending[r].pop(0)]

    def _rank_of(self, topic: bytes) -> int:
        rank = topic[len(self.TOPIC):-1]
        if not (topic.startswith(self.TOPIC) and topic.endswith(b"|") and rank.isdigit() and int(rank) < self.ranks):
            raise InvalidInput("rollout_transport", f"message topic {topic!r} on {self.endpoint} is not one of "
                               f"data_rank|0..{self.ranks - 1}|")
        return int(rank)

    def close(self) -> None:
        if not self._announced:
            self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._ready.close(linger=0)
        self._context.term()


def is_self_connection(sock: socket.socket) -> bool:
    """Whether a connected TCP socket is connected to itself (local and peer address the same)."""
    return sock.getsockname() == sock.getpeername()


def wait_listening(host: str, port: int, deadline: float | None, poll_s: float = 0.1) -> bool:
    """Poll `host:port` with plain TCP connects every `poll_s` until one reaches a listener (True) or
    `deadline` (time.monotonic(); None: no limit) passes (False). A probe that connected to itself
    (module doc) is closed at once, which frees the port again, and does not count."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0) as probe:
                if not is_self_connection(probe):
                    return True
        except OSError:
            pass
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def open_receiver(transport: FileSystemTransport | ZmqTransport, run_dir: Path, ranks: int, poll_s: float,
                  wait_timeout_s: float | None) -> RolloutReceiver:
    """The receiver of `transport` (a zmq one announces its ranks at its first receive)."""
    if isinstance(transport, ZmqTransport):
        return ZmqReceiver(transport, ranks, wait_timeout_s)
    return FileSystemReceiver(Path(run_dir), ranks, poll_s, wait_timeout_s)


def parse_transport(value: Any, field: str) -> FileSystemTransport | ZmqTransport:
    """`rollout_transport` as prime-rl reads it (default zmq); InvalidInput naming the key otherwise."""
    from pydantic import TypeAdapter, ValidationError  # noqa: PLC0415

    table = {"type": "zmq"} if value is None else value
    if not isinstance(table, dict):
        raise InvalidInput(field, "must be a table with type = \"zmq\" or \"filesystem\"")
    table = {"type": "zmq", **table}
    if table["type"] not in ("zmq", "filesystem"):
        raise InvalidInput(f"{field}.type", f"is {table['type']!r}; prime-rl's rollout transports are \"zmq\" "
                           "(its default) and \"filesystem\"")
    try:
        return TypeAdapter(RolloutTransport).validate_python(table)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if p not in ("zmq", "filesystem"))
        raise InvalidInput(f"{field}.{where}" if where else field, err["msg"]) from None
