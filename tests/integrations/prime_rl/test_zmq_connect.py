"""floe's zmq rollout receiver connects only to ports that listen (transport.py's module doc: a zmq
reconnect loop aimed at an ephemeral-range port nobody listens on can connect to itself and hold
the port; prime-rl CI hit it as the orchestrator's "Address already in use" on its READY port).

Real sockets on loopback: a deliberately self-connected TCP socket, a listener that appears late,
and pyzmq PUB/PULL sockets bound the way prime-rl's orchestrator binds them, after the receiver
already waits."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq

from floe.errors import StateError
from floe.integrations.prime_rl.formats import MicroBatch
from floe.integrations.prime_rl.transport import ZmqReceiver, ZmqTransport, is_self_connection, wait_listening
from tests.server.conftest import free_port, free_port_pair

pytestmark = pytest.mark.timeout(60)


def test_a_socket_connected_to_its_own_port_is_a_self_connection() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())  # TCP simultaneous open with itself: what a reconnect loop can hit
        assert is_self_connection(s)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as c:
        assert not is_self_connection(c)


def test_wait_listening_returns_when_a_listener_appears_and_gives_up_at_the_deadline() -> None:
    port = free_port()
    start = time.monotonic()
    assert not wait_listening("127.0.0.1", port, deadline=start + 0.5)
    assert 0.5 <= time.monotonic() - start < 3

    listeners: list[socket.socket] = []
    timer = threading.Timer(0.7, lambda: listeners.append(socket.create_server(("127.0.0.1", port))))
    timer.start()
    try:
        start = time.monotonic()
        assert wait_listening("127.0.0.1", port, deadline=start + 10)
        assert time.monotonic() - start >= 0.6  # it waited for the listener rather than "connecting" early
    finally:
        timer.join()
        for s in listeners:
            s.close()


def test_the_receiver_waits_for_an_orchestrator_that_binds_late_and_names_the_port_when_none_does() -> None:
    port = free_port_pair()
    receiver = ZmqReceiver(ZmqTransport(host="127.0.0.1", port=port), ranks=1, wait_timeout_s=1.0)
    try:
        with pytest.raises(StateError, match=f"listen on tcp://127.0.0.1:{port} "):
            receiver.receive(1)
    finally:
        receiver.close()

    batch = MicroBatch(input_ids=[1, 2, 3], loss_mask=[False, True, True], advantages=[0.0, 1.0, 1.0],
                       inference_logprobs=[0.0, -0.5, -0.25], position_ids=[0, 1, 2], sequence_lengths=[3],
                       temperatures=[1.0, 1.0, 1.0], env_names=["e"] * 3, seq_lens=[3], rl_weights=[1.0] * 3)
    errors: list[BaseException] = []

    def orchestrator() -> None:  # prime-rl's sender's sockets and READY barrier, bound 1.5 s late
        try:
            time.sleep(1.5)
            context = zmq.Context()
            pub, ready = context.socket(zmq.PUB), context.socket(zmq.PULL)
            pub.bind(f"tcp://127.0.0.1:{port}")
            ready.bind(f"tcp://127.0.0.1:{port + 1}")
            assert ready.poll(20_000), "no READY from the receiver"
            assert ready.recv() == b"0"
            time.sleep(0.2)
            pub.send_multipart([b"data_rank|0|", msgspec.msgpack.encode([batch])])
            time.sleep(0.5)
            pub.close(linger=0)
            ready.close(linger=0)
            context.term()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test thread
            errors.append(e)

    thread = threading.Thread(target=orchestrator, daemon=True)
    thread.start()
    receiver = ZmqReceiver(ZmqTransport(host="127.0.0.1", port=port), ranks=1, wait_timeout_s=30)
    try:
        assert receiver.receive(1) == [batch]
    finally:
        receiver.close()
        thread.join(10)
    assert not errors, errors
