"""floe.locks.FairRLock: reentrant, and handed round-robin over tenants (no tenant starves)."""

from __future__ import annotations

import threading
import time

from floe.locks import FairRLock, tenant


def test_the_lock_is_reentrant_and_only_its_holder_releases_it() -> None:
    lock = FairRLock()
    with lock, lock:
        pass
    try:
        lock.release()
    except RuntimeError:
        pass
    else:
        raise AssertionError("a release without the lock must fail")


def test_a_tenant_waiting_behind_anothers_backlog_gets_the_next_turn() -> None:
    lock = FairRLock()
    order: list[str] = []
    with tenant("bob"):
        lock.acquire()  # bob's call holds it while the waiters line up
    threads = []

    def call(who: str, name: str) -> None:
        with tenant(who), lock:
            order.append(name)

    for i in range(5):
        threads.append(threading.Thread(target=call, args=("bob", f"b{i}")))
        threads[-1].start()
        while len(lock._waiting) < i + 1:  # until it queued (no timing assumption)
            time.sleep(0.001)
    threads.append(threading.Thread(target=call, args=("alice", "a0")))
    threads[-1].start()
    while len(lock._waiting) < 6:
        time.sleep(0.001)
    lock.release()
    for t in threads:
        t.join(10)
    assert order.index("a0") == 0, order
    assert [n for n in order if n != "a0"] == [f"b{i}" for i in range(5)]  # each tenant's own in order
