"""The Ledger in isolation: sequence order, replays of used ids, conflicts and gaps."""

from __future__ import annotations

import asyncio

import pytest

from floe.server.errors import ApiError
from floe.server.ordering import Ledger, Reply


def run(coro):
    return asyncio.run(coro)


def test_requests_run_in_sequence_order_and_retries_replay() -> None:
    async def main() -> None:
        ledger, ran = Ledger(window=8, max_clients=4, gap_timeout=5), []

        def job(seq: int):
            async def produce() -> Reply:
                ran.append(seq)
                await asyncio.sleep(0.01)
                return Reply(200, f"r{seq}".encode(), "text/plain")
            return produce

        first = await ledger.run("c", 1, b"h1", job(1))
        late = asyncio.create_task(ledger.run("c", 3, b"h3", job(3)))  # arrives before 2
        await asyncio.sleep(0.02)
        assert ran == [1]
        two, dup_two = await asyncio.gather(ledger.run("c", 2, b"h2", job(2)), ledger.run("c", 2, b"h2", job(2)))
        three = await late
        assert ran == [1, 2, 3]  # 2 ran once, 3 waited for it
        assert (first[0].body, two[0].body, three[0].body) == (b"r1", b"r2", b"r3")
        assert dup_two == (two[0], True) and two[1] is False
        replay, replayed = await ledger.run("c", 1, b"h1", job(1))
        assert replay.body == b"r1" and replayed and ran == [1, 2, 3]
        with pytest.raises(ApiError) as e:
            await ledger.run("c", 2, b"other", job(2))
        assert e.value.status == 409 and e.value.error == "sequence_reused"

    run(main())


def test_gap_times_out_with_425_and_old_ids_expire() -> None:
    async def main() -> None:
        ledger = Ledger(window=2, max_clients=4, gap_timeout=0.1)

        async def ok() -> Reply:
            return Reply(200, b"", "x")

        for seq in (10, 11, 12, 13):  # the first id seen sets the start
            await ledger.run("c", seq, b"h", ok)
        with pytest.raises(ApiError) as e:
            await ledger.run("c", 15, b"h", ok)
        assert e.value.status == 425
        with pytest.raises(ApiError) as e:
            await ledger.run("c", 10, b"h", ok)
        assert e.value.status == 409 and e.value.error == "sequence_expired"

    run(main())
