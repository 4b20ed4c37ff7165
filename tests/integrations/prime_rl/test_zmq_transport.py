"""floe's zmq rollout receiver against prime-rl's own sender (marker prime_rl, scripts/ci/prime-rl.sh):
prime-rl's `ZMQMicroBatchSender` (the orchestrator's, with its READY barrier) sends three steps for two
data ranks; `ZmqReceiver` gets each step's micro-batches of both ranks, field for field, in order, and
names the missing rank when a step does not come."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec
import pytest

from floe.errors import StateError
from floe.integrations.prime_rl.formats import MicroBatch
from floe.integrations.prime_rl.transport import ZmqReceiver, ZmqTransport
from tests.server.conftest import free_port_pair

pytestmark = [pytest.mark.prime_rl, pytest.mark.timeout(300)]


def _prime_micro_batch(step: int, rank: int, n: int):
    from prime_rl.transports.rollouts.types import MicroBatch as PrimeMicroBatch

    tokens = [step * 100 + rank * 10 + i for i in range(4 + n)]
    return PrimeMicroBatch(input_ids=tokens, loss_mask=[i > 1 for i in range(len(tokens))],
                           advantages=[0.5 * step - rank] * len(tokens), inference_logprobs=[-0.25] * len(tokens),
                           position_ids=list(range(len(tokens))), sequence_lengths=[len(tokens)],
                           temperatures=[1.0] * len(tokens), env_names=["reverse-text"] * len(tokens),
                           seq_lens=[len(tokens)], rl_weights=[1.0] * len(tokens))


def test_prime_rl_zmq_sender_to_floe_receiver(tmp_path: Path) -> None:
    from prime_rl.configs.shared import ZMQTransportConfig
    from prime_rl.transports.rollouts import setup_micro_batch_sender

    port = free_port_pair()  # the READY socket is port + 1
    prime_cfg = ZMQTransportConfig(host="127.0.0.1", port=port)
    ours = ZmqTransport(host="127.0.0.1", port=port)
    grids = {step: [[_prime_micro_batch(step, r, n) for n in range(2)] for r in range(2)] for step in (1, 2, 3)}
    errors: list[BaseException] = []

    def orchestrator() -> None:
        async def send_all() -> None:
            sender = setup_micro_batch_sender(tmp_path, 2, 1, prime_cfg)  # prime-rl's factory, as its orchestrator
            try:
                for step in (1, 2, 3):
                    await sender.send(grids[step])
                await asyncio.sleep(0.5)  # let the last message leave before the socket closes
            finally:
                sender.close()
        try:
            asyncio.run(send_all())
        except BaseException as e:  # noqa: BLE001 - re-raised by the test thread
            errors.append(e)

    thread = threading.Thread(target=orchestrator, daemon=True)
    thread.start()
    receiver = ZmqReceiver(ours, ranks=2, wait_timeout_s=60)
    try:
        for step in (1, 2, 3):
            got = receiver.receive(step)
            want = [msgspec.convert(msgspec.to_builtins(mb), MicroBatch) for r in range(2) for mb in grids[step][r]]
            assert got == want, step
        thread.join(30)
        assert not errors, errors
        receiver.wait_timeout_s = 1.0
        with pytest.raises(StateError, match="step 4's rollouts of rank 0"):
            receiver.receive(4)
    finally:
        receiver.close()
